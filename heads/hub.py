"""Uploading a saved drafter folder to the Hugging Face Hub."""

from __future__ import annotations

import os

from huggingface_hub import HfApi

from .weights import WEIGHTS_NAME, check_weights_file

REQUIRED = ("config.json", WEIGHTS_NAME, "README.md")


def check_push(repo_id: str, token: str | None = None, what: str = "push_to_hub") -> str:
    """Before any work that ends in an upload to `repo_id`: a token is there, the Hub answers and accepts it,
    and the repo's owner is its user or one of its organizations. Returns the user's name; a ValueError
    (`what` names the setting) says what to fix. One request (whoami)."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HTTPError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
    )

    no_token = ValueError(f"{what}={repo_id}: no Hugging Face token found; log in with `hf auth login` or set "
                          "HF_TOKEN (a token with write access), or leave the upload out")
    token = token or get_token()
    if token is None:
        raise no_token
    try:
        me = HfApi(token=token).whoami()
    except LocalTokenNotFoundError:
        raise no_token from None
    except OfflineModeIsEnabled:
        raise ValueError(f"{what}={repo_id}, but HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it, or "
                         "leave the upload out") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        reason = "the Hub does not accept the token (expired or revoked?): log in again with `hf auth login`" \
            if status == 401 else f"the Hub answered {status}: {err}"
        raise ValueError(f"{what}={repo_id}: {reason}") from None
    except (OSError, HTTPError) as err:  # DNS, refused connection, timeout, proxy
        raise ValueError(f"{what}={repo_id}: the Hugging Face Hub cannot be reached ({type(err).__name__}: {err}); "
                         "check the network (or HF_ENDPOINT), or leave the upload out and push later with "
                         "scripts/push_to_hub.py") from None
    owners = [me.get("name")] + [org.get("name") for org in me.get("orgs") or []]
    owner = repo_id.split("/")[0] if "/" in repo_id else me.get("name")
    if owner not in owners:
        raise ValueError(f"{what}={repo_id}: the token belongs to {me.get('name')!r}, who can create repos only under "
                         f"{', '.join(map(repr, owners))}, not {owner!r}; name the repo as one of them")
    if ((me.get("auth") or {}).get("accessToken") or {}).get("role") == "read":
        raise ValueError(f"{what}={repo_id}: the token of {me.get('name')!r} is read-only; create one with write "
                         "access (https://huggingface.co/settings/tokens) and log in with it")
    return me.get("name")


def push(folder, repo_id: str, *, private: bool | None = None, token: str | None = None,
         revision: str | None = None, commit_message: str | None = None, create_pr: bool = False) -> str:
    """Upload a folder written by `save_pretrained` (config, safetensors, model card) to `repo_id`.

    The folder is checked first: the three files must be there, the weights must be readable safetensors,
    and no pickled weights are uploaded. Returns the commit URL.
    """
    missing = [n for n in REQUIRED if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise ValueError(f"{folder} is not a saved drafter: missing {missing}. Save it with "
                         "drafter.save_pretrained(folder) first.")
    check_weights_file(os.fspath(folder))
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision, create_pr=create_pr,
                             commit_message=commit_message or "Upload selfspec drafter",
                             ignore_patterns=["*.bin", "*.pt", "*.pth", "*.pkl"])
    return str(info)
