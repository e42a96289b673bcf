"""Exports (heads/export.py) as files on disk: nothing of the user's lost, nothing loaded as something else.

- An export is written whole (heads.folders.written_whole): one failing or killed part-way leaves the earlier export
  in the folder byte for byte, and it loads as before (issue 55, findings 1 and 2).
- An export of ours whose files are not the ones it wrote (one missing, or the config of one export beside the
  weights of another) is refused naming the file.
- An export loaded onto a target other than the one it records is refused naming the field (finding 4).
- Each export function refuses a drafter of another kind by name, and a drafter folder whose config is not an
  object or does not match its weights gets selfspec's message (finding 22).
- A folder that cannot take an export or a staging (a file, under a file, read-only) is refused by the library
  and by scripts/export.py, serve.py --export-dir and push_to_hub.py --stage-dir before anything loads (finding 20).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from foreign_checkpoints import target_model

import heads
from heads import export, export_cli, folders, publish
from heads.export import export_formats
from train.apps import serve

ROOT = Path(__file__).resolve().parent.parent
KIND = {"speculators": "eagle3", "sglang": "eagle3", "vllm": "medusa", "dflash": "dflash"}
_TARGET = {}


def target():
    if "t" not in _TARGET:
        _TARGET["t"] = target_model()  # 8 layers: EAGLE-3's default feature layers are distinct, as SGLang needs
    return _TARGET["t"]


def drafter(fmt: str, seed: int = 0, **options):
    """A drafter of the format's kind on the 8-layer target, its weights moved off their initial values by `seed`
    so that two seeds are two different drafters of the same shapes."""
    options = {"draft_vocab_size": 48, **options} if KIND[fmt] == "eagle3" else options
    model = heads.build(KIND[fmt], target(), **options)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return model


def fingerprint(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- written whole: a failing or killed export leaves the earlier one ---------------------------------------------


def _fails_half_way(write, path_arg: int):
    """`write` that writes its file, cuts it to half and raises KeyboardInterrupt, as a Ctrl-C part-way would."""
    def failing(*args, **kwargs):
        write(*args, **kwargs)
        path = Path(args[path_arg])
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        raise KeyboardInterrupt
    return failing


def _fail_at(monkeypatch, where: str) -> None:
    if where == "weights":
        monkeypatch.setattr(export, "save_file", _fails_half_way(export.save_file, 1))
    elif where == "mask":  # DFlash's mask_embedding.pt, written after the weights
        monkeypatch.setattr(export.torch, "save", _fails_half_way(torch.save, 1))
    else:  # config.json, written last
        def dump(obj, f, **kwargs):
            f.write(json.dumps(obj)[:100])
            raise KeyboardInterrupt
        monkeypatch.setattr(export.json, "dump", dump)


@pytest.mark.parametrize("fmt,where", [(f, w) for f in export_formats() for w in ("weights", "config")] + [("dflash", "mask")])
def test_an_export_failing_part_way_leaves_the_earlier_one(fmt, where, tmp_path, monkeypatch):
    out = tmp_path / "export"
    first = drafter(fmt, seed=1)
    export_formats()[fmt].export(first, out)
    before = fingerprint(out)
    _fail_at(monkeypatch, where)
    with pytest.raises(KeyboardInterrupt):
        export_formats()[fmt].export(drafter(fmt, seed=2), out)
    monkeypatch.undo()
    assert fingerprint(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # the half-written folder is gone
    assert same_weights(export_formats()[fmt].load(out, target=target()), first)


KILLED_EXPORT = """
import os, sys
sys.path.insert(0, "tests")
import heads
from heads import export
real = export.save_file
def killed(tensors, path, **kwargs):
    real(tensors, path, **kwargs)
    os._exit(9)  # no cleanup runs, as with SIGKILL or a power cut
export.save_file = killed
export.export(heads.load(sys.argv[1]), sys.argv[2])
"""


def test_an_export_killed_part_way_leaves_the_earlier_one(tmp_path):
    """A process killed outright runs no cleanup: the earlier export stays byte for byte and loads, the half-written
    folder beside it is left, and the next export removes it."""
    out, second = tmp_path / "export", drafter("speculators", seed=2)
    first = drafter("speculators", seed=1)
    export.export_speculators(first, out)
    before = fingerprint(out)
    second.save_pretrained(tmp_path / "second")
    done = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(tmp_path / "second"), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-2000:]
    assert fingerprint(out) == before
    assert same_weights(heads.load(out, target=target()), first)
    assert (tmp_path / ".export.selfspec-partial").is_dir()
    export.export_speculators(second, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "second"]
    assert same_weights(heads.load(out, target=target()), second)


def test_a_write_killed_between_its_renames_is_undone_by_the_next(tmp_path):
    """The one moment the destination is not in place: moved aside, the new folder not yet renamed in. The next write
    puts the earlier folder back first; if that write fails too, the earlier folder is what stays."""
    dest = tmp_path / "export"
    dest.mkdir()
    (dest / "a.txt").write_text("earlier")
    partial, old = folders._siblings(dest)
    os.replace(dest, old)  # the state a kill right after the first rename leaves
    partial.mkdir()
    (partial / "a.txt").write_text("half")
    with pytest.raises(RuntimeError, match="writer failed"), folders.written_whole(dest) as folder:
        (folder / "a.txt").write_text("new")
        raise RuntimeError("writer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (dest / "a.txt").read_text() == "earlier"


def test_an_export_through_a_link_replaces_the_folder_it_points_to(tmp_path):
    (tmp_path / "exports").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "exports" / "eagle3", target_is_directory=True)
    for seed in (1, 2):
        last = drafter("speculators", seed=seed)
        export.export_speculators(last, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["eagle3"]
    assert same_weights(heads.load(tmp_path / "link", target=target()), last)


# ---- an export whose files are not the ones it wrote ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(export_formats()))
def test_an_export_without_its_weights_is_refused(fmt, tmp_path):
    export_formats()[fmt].export(drafter(fmt), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="an export of selfspec's without its model.safetensors: the export was "
                                         "interrupted or copied in part; export the drafter again"):
        export_formats()[fmt].load(tmp_path, target=target())


@pytest.mark.parametrize("recorded", [True, False], ids=["files-recorded", "older-export"])
def test_a_dflash_export_without_its_mask_vector_is_refused(recorded, tmp_path):
    """Without mask_embedding.pt the loader would take the target's embedding of mask_token_id for the trained mask
    vector, silently; exports made before the files were recorded are refused the same way."""
    export.export_dflash(drafter("dflash"), tmp_path)
    if not recorded:
        config = json.loads((tmp_path / "config.json").read_text())
        del config["selfspec"]["files"]
        (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "mask_embedding.pt").unlink()
    for load in (heads.load, export.import_dflash):
        with pytest.raises(ValueError, match="without its mask_embedding.pt"):
            load(tmp_path, target=target())


@pytest.mark.parametrize("fmt", list(export_formats()))
def test_the_config_of_one_export_beside_the_weights_of_another_is_refused(fmt, tmp_path):
    """What a kill between config.json and model.safetensors left before exports were written whole: the same shapes,
    so every key and shape matches, but another drafter's weights (for EAGLE-3, other feature layers too)."""
    options = {"feature_layers": [1, 3, 6]} if KIND[fmt] == "eagle3" else {}
    export_formats()[fmt].export(drafter(fmt, seed=1), tmp_path / "old")
    export_formats()[fmt].export(drafter(fmt, seed=2, **options), tmp_path / "new")
    shutil.copy(tmp_path / "new" / "config.json", tmp_path / "old" / "config.json")
    with pytest.raises(ValueError, match=r"its (mask_embedding.pt and )?model.safetensors (is|are) not the files? this "
                                         r"export wrote .* the folder mixes files of two exports"):
        export_formats()[fmt].load(tmp_path / "old", target=target())


# ---- an export loaded onto another target --------------------------------------------------------------------------


OTHER_TARGETS = {
    "6 layers": (lambda: tiny_model("llama", num_hidden_layers=6), "layer count: checkpoint 8, target 6"),
    "qwen2": (lambda: tiny_model("qwen2", num_hidden_layers=8), "architecture (model_type): checkpoint 'llama', "
                                                                  "target 'qwen2'"),
    "vocabulary": (lambda: tiny_model("llama", num_hidden_layers=8, vocab_size=128), "checkpoint 96, target 128"),
    "width": (lambda: tiny_model("llama", num_hidden_layers=8, hidden_size=48, intermediate_size=96),
              "checkpoint 32, target 48"),
}


@pytest.mark.parametrize("fmt", list(export_formats()))
@pytest.mark.parametrize("other", list(OTHER_TARGETS))
def test_an_export_onto_another_target_is_refused_by_field(fmt, other, tmp_path):
    """The export records its target (its selfspec block); the loader used to overwrite that with the new target's
    fields, so a drafter for an 8-layer Llama loaded and ran on a 6-layer one or a Qwen2."""
    export_formats()[fmt].export(drafter(fmt), tmp_path)
    build, message = OTHER_TARGETS[other]
    loaders = [export_formats()[fmt].load] + ([heads.load] if fmt != "vllm" else [])  # vLLM Medusa: import_medusa_vllm only
    for load in loaders:
        with pytest.raises(ValueError, match=r"does not fit the target(.|\n)*" + message.replace("(", r"\(")
                           .replace(")", r"\)")):
            load(tmp_path, target=build())


# ---- exports of the wrong kind, drafter folders that are not what they say --------------------------------------


@pytest.mark.parametrize("fmt", list(export_formats()))
def test_an_export_function_refuses_another_kind_by_name(fmt, tmp_path):
    other = {"eagle3": "medusa", "medusa": "eagle3", "dflash": "eagle3"}[KIND[fmt]]
    writes = {"eagle3": "Eagle3Model", "medusa": "MedusaModel", "dflash": "DFlashModel"}[KIND[fmt]]
    with pytest.raises(ValueError, match=f"writes {writes} drafters; this is a .*drafter kind '{other}'.*its formats"):
        export_formats()[fmt].export(heads.build(other, target()), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_drafter_folder_whose_config_is_a_list_is_refused(tmp_path):
    drafter("speculators").save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="its config.json holds a JSON list, not an object"):
        heads.load(tmp_path)


def test_a_config_whose_sizes_do_not_match_the_weights_gets_selfspecs_message(tmp_path):
    drafter("speculators").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["draft_vocab_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"the sizes in its config.json do not match the weights in its "
                                         r"model.safetensors \(d2t: file \(48,\), config \(40,\); lm_head.weight: file "
                                         r"\(48, 32\), config \(40, 32\)\)"):
        heads.load(tmp_path)


# ---- folders that cannot take an export or a staging, refused before anything loads ------------------------------


@contextlib.contextmanager
def read_only(folder: Path, monkeypatch):
    """`folder` made read-only: by its mode, and where that does not bind (root), by what os.access says of it."""
    folder.mkdir(exist_ok=True)
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        real = os.access
        monkeypatch.setattr(folders.os, "access", lambda p, mode, **kw: False if Path(p) == folder and mode & os.W_OK
                            else real(p, mode, **kw))
    try:
        yield folder
    finally:
        folder.chmod(0o755)


def _export_cli(*argv) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = export_cli.main([str(a) for a in argv])
    if code:
        raise ValueError(err.getvalue())
    return ""


def _serve_cli(*argv) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = serve.main([str(a) for a in argv])
    if code:
        raise ValueError(err.getvalue())
    return ""


# (what the user does, where the place is (a file, under a file, read-only, under a read-only folder), words)
PLACES = {
    "a file": (lambda tmp: tmp / "afile", "afile is a file; choose an empty or new folder"),
    "under a file": (lambda tmp: tmp / "afile" / "out", "cannot be made: {tmp}/afile is a file, not a folder"),
    "read-only": (lambda tmp: tmp / "ro", "cannot be written: {tmp}/ro is read-only for this user"),
    "under a read-only folder": (lambda tmp: tmp / "ro" / "out", "cannot be written: {tmp}/ro is read-only"),
}
COMMANDS = {
    "heads.export.export": lambda saved, place: export.export(heads.load(saved), place),
    "scripts/export.py": lambda saved, place: _export_cli(saved, place),
    "scripts/serve.py --export-dir": lambda saved, place: _serve_cli(saved, "--export-dir", place, "--target", "x",
                                                                      "--dry-run"),
    "scripts/push_to_hub.py --stage-dir": lambda saved, place: publish.main([str(saved), "--repo-id", "me/x",
                                                                             "--dry-run", "--stage-dir", str(place)]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("place", list(PLACES))
def test_a_folder_that_cannot_take_the_files_is_refused_first(command, place, tmp_path, monkeypatch):
    saved = tmp_path / "drafter"
    drafter("speculators").save_pretrained(saved)
    (tmp_path / "afile").write_text("mine")
    where, words = PLACES[place]
    before = {p.name for p in tmp_path.iterdir()}
    if command != "heads.export.export":  # the scripts check the folder before the drafter loads
        def no_load(*args, **kwargs):
            pytest.fail("the drafter loaded before the folder was checked")
        for module in (heads, publish, export_cli):
            monkeypatch.setattr(module, "load", no_load)
    with read_only(tmp_path / "ro", monkeypatch):
        with pytest.raises(ValueError) as info:
            COMMANDS[command](saved, where(tmp_path))
    what = "--stage-dir" if "stage" in command else "export folder"
    assert f"{what} {where(tmp_path)}" in str(info.value)
    assert words.format(tmp=tmp_path) in str(info.value), str(info.value)
    assert {p.name for p in tmp_path.iterdir()} == before | {"ro"} and (tmp_path / "afile").read_text() == "mine"
    assert not any((tmp_path / "ro").iterdir())


def test_export_cli_writes_and_replaces_its_own_export(tmp_path):
    saved, out = tmp_path / "drafter", tmp_path / "out"
    drafter("speculators").save_pretrained(saved)
    for _ in range(2):
        _export_cli(saved, out, "--format", "sglang")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "out"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_an_export_that_cannot_be_written_says_so_and_keeps_the_earlier_one(tmp_path, monkeypatch):
    """A full disk while writing the weights: the error says what and where; the earlier export stays."""
    out = tmp_path / "export"
    export.export_speculators(drafter("speculators", seed=1), out)
    before = fingerprint(out)

    def full(tensors, path, **kwargs):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export, "save_file", full)
    with pytest.raises(OSError, match=f"could not write the export {out}: No space left on device; an earlier export "
                                      "there is left as it was"):
        export.export_speculators(drafter("speculators", seed=2), out)
    assert fingerprint(out) == before
