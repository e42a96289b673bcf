"""`selfspec <verb>`: every verb answers --help as itself, the commands the README and docs/usage.md show parse
from a clone, and `selfspec import` turns another project's checkpoint into a drafter of ours."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from foreign_checkpoints import target_model, write_eagle_authors
from train_fixtures import character_tokenizer

import heads
from train import cli

ROOT = Path(__file__).resolve().parents[1]


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    assert ended.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("verb", sorted(cli.VERBS))
def test_every_verb_answers_help_under_its_own_name(verb, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main names the verb in argv[0] for argparse
    out = help_of([verb, "--help"], capsys)
    assert f"usage: selfspec {verb}" in out


def test_the_verb_list_and_a_wrong_verb(capsys):
    assert cli.main([]) == 2
    listing = capsys.readouterr().out
    assert all(f"  {verb} " in listing for verb in cli.VERBS)
    with pytest.raises(SystemExit) as ended:
        cli.main(["trian"])
    assert ended.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_train_help_lists_every_setting(capsys, monkeypatch):
    from train.config import TrainConfig

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = help_of(["train", "--help"], capsys)
    missing = [name for name in TrainConfig.__dataclass_fields__ if f"  {name} = " not in out]
    assert not missing, missing


def shown_commands() -> list[str]:
    """The selfspec, python and accelerate commands in the README's and docs/usage.md's shell blocks, lines joined."""
    commands = []
    for doc in ("README.md", "docs/usage.md"):
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.DOTALL):
            text = re.sub(r"\\\n\s*", " ", block)
            for line in text.splitlines():
                line = line.split("  #")[0].strip()
                if re.match(r"(\.venv/bin/)?(selfspec|python|accelerate) ", line):
                    commands.append(line)
    return commands


def module_argv(command: str) -> tuple[str, list[str]]:
    """(module whose main runs, its argv) for a shown command."""
    words = shlex.split(command.replace("[key=value ...]", ""))
    words[0] = Path(words[0]).name
    if words[0] == "selfspec":
        return "train.cli", words[1:]
    if words[:2] == ["accelerate", "launch"]:
        words = ["python", *words[2:]]
    if words[1] == "-m":
        return words[2], words[3:]
    script = (ROOT / words[1]).read_text()
    return re.search(r"^from (\S+) import main$", script, flags=re.MULTILINE).group(1), words[2:]


def test_the_docs_show_commands():
    assert len(shown_commands()) >= 5, shown_commands()


@pytest.mark.parametrize("command", shown_commands())
def test_every_shown_command_parses_from_a_clone(command, capsys, monkeypatch):
    """Each command with --help appended: its module exists and its parser takes the flags it is shown with."""
    import importlib

    module, argv = module_argv(command)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as ended:
        importlib.import_module(module).main([*argv, "--help"])
    assert ended.value.code == 0, capsys.readouterr().err
    for path in re.findall(r"(?<![\w/])(?:data|configs)/[\w./-]+", command):  # the shipped files it reads
        assert (ROOT / path).exists(), path


def test_import_saves_another_projects_checkpoint_as_ours(tmp_path):
    target = target_model()
    target.save_pretrained(tmp_path / "target")
    character_tokenizer(["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"], "abc", None).save_pretrained(
        tmp_path / "target")
    write_eagle_authors(tmp_path / "eagle3", target)
    assert cli.main(["import", str(tmp_path / "eagle3"), "--target", str(tmp_path / "target"),
                     "--out", str(tmp_path / "ours")]) == 0
    assert heads.imported_format(tmp_path / "ours") is None  # a selfspec drafter now
    ours, theirs = heads.load(tmp_path / "ours"), heads.load(tmp_path / "eagle3", target=target)
    mine = dict(ours.named_parameters())
    assert all((mine[name] == param).all() for name, param in theirs.named_parameters())
    with pytest.raises(SystemExit):  # never over an existing folder
        cli.main(["import", str(tmp_path / "eagle3"), "--target", str(tmp_path / "target"),
                  "--out", str(tmp_path / "ours")])


@pytest.mark.slow  # the real SmolLM2-135M target, 128 new tokens
def test_the_readmes_python_snippet_runs_for_real(tmp_path, monkeypatch, capsys):
    """README.md's Python snippet, as written, from a folder where `make demo` left its drafter (the shipped drafter
    saved there stands in for it)."""
    (snippet,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    heads.load("smollm2-135m-instruct-eagle3").save_pretrained(tmp_path / "runs" / "demo" / "drafter")
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, str(ROOT / "README.md"), "exec"), {"__name__": "readme"})
    tau = float(capsys.readouterr().out.strip().splitlines()[-1])
    assert tau >= 1.0
