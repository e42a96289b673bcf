"""Uploading a saved drafter folder to the Hugging Face Hub."""

from __future__ import annotations

import os

from huggingface_hub import HfApi

from .weights import WEIGHTS_NAME, check_weights_file

REQUIRED = ("config.json", WEIGHTS_NAME, "README.md")


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
