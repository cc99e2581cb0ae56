"""`dsv4-convert --help` and each subcommand's: every option described, example lines that parse."""
import argparse
import shlex

import pytest

from dsv4_jax.io.convert.cli import build_parser, main

SUBCOMMANDS = ("hf", "gguf", "drafter", "verify")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    ap = build_parser()
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == sorted(SUBCOMMANDS)
    return {"": ap, **sub.choices}


def _examples(help_text: str) -> list[str]:
    """The `dsv4-convert ...` lines under 'examples:', trailing `# comment` removed."""
    assert "\nexamples:\n" in help_text, help_text
    block = help_text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip().startswith("dsv4-convert ")]


@pytest.mark.parametrize("name", ("",) + SUBCOMMANDS)
def test_help_describes_every_option_and_has_examples(name, capsys):
    parser = _parsers()[name]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert all(c.help for c in action._choices_actions), name      # each subcommand a one-line summary
            continue
        assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings or action.dest)
    with pytest.raises(SystemExit) as e:
        main([name, "--help"] if name else ["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    examples = _examples(text)
    assert examples, text
    if name:
        assert any(shlex.split(x)[1] == name for x in examples), examples
    else:
        assert {shlex.split(x)[1] for x in examples} == set(SUBCOMMANDS)
    for x in examples:                   # every example is a valid command line
        args = build_parser().parse_args(shlex.split(x)[1:])
        assert args.cmd == shlex.split(x)[1]
