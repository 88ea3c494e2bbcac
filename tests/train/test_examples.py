"""JSONL fine-tuning data (`pyml/train/examples.py`): the loss on the answers only, found by
rendering the conversation's prefixes with the folder's own chat template; one row per example,
padded so that a row computes exactly what the example alone does; bad data named by file and
line, before anything runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate
from pyml.package.cpu.loss import IGNORED_TARGET
from pyml.train import examples
from tests.support.chat_templates import GEMMA3_IT
from tests.support.project_packages import project_package

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What does the with statement do?"},
    {"role": "assistant", "content": "It wraps a block in a context manager's enter and exit."},
    {"role": "user", "content": "And for   files?\n\nThanks."},
    {"role": "assistant", "content": "The file is closed when the block ends, 2 lines or 200."},
]
END_OF_TURN = {"smollm2": "<|im_end|>", "gemma3": "<end_of_turn>"}


def folder_with_template(source: Path, folder: Path, template: str | None) -> Path:
    """The tokenizer files of `source`, with `template` as the chat template (None: keep its own)."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, folder / name)
    if template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def families(smollm2_folder, gemma3_dir, tmp_path_factory) -> dict[str, Path]:
    """SmolLM2's folder with its own template; Gemma 3's with its instruction-tuned template."""
    root = tmp_path_factory.mktemp("templates")
    return {"smollm2": smollm2_folder, "gemma3": folder_with_template(gemma3_dir, root / "gemma3", GEMMA3_IT)}


def tokenization(folder: Path, train_on: str = "assistant") -> examples.Tokenization:
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return examples.Tokenization(tokenizer, ChatTemplate.of_folder(folder), eos, train_on)


def target_runs(example: examples.Example) -> list[list[int]]:
    """The targeted token ids, in contiguous runs."""
    runs, previous = [], False
    for token, targeted in zip(example.ids, example.targets):
        if targeted:
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = targeted
    return runs


@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_the_targets_are_each_answer_and_its_end_of_turn(families, family):
    """Multi-turn, with a system prompt: the kept tokens decode to exactly each assistant message
    followed by its end-of-turn token; no system or user text is a target."""
    tokens = tokenization(families[family])
    example = tokens.example(examples.Record("chat.jsonl:1", "chat", {"messages": CONVERSATION}))
    answers = [message["content"] for message in CONVERSATION if message["role"] == "assistant"]
    decoded = [tokens.tokenizer.decode(run, skip_special_tokens=False) for run in target_runs(example)]
    assert decoded == [answer + END_OF_TURN[family] for answer in answers]
    # the whole is the template's rendering, tokenised as `pyml generate --chat` tokenises it
    whole = ChatTemplate.of_folder(families[family]).render(CONVERSATION, add_generation_prompt=False)
    assert example.ids == tokens.tokenizer.encode(whole, add_special_tokens=False).ids


def test_train_on_all_targets_every_token(families):
    tokens = tokenization(families["smollm2"], train_on="all")
    example = tokens.example(examples.Record("chat.jsonl:1", "chat", {"messages": CONVERSATION}))
    assert all(example.targets)


def test_instructions_target_the_completion_and_texts_everything(families):
    tokens = tokenization(families["gemma3"])
    instruction = tokens.example(examples.Record(
        "i.jsonl:1", "instruction", {"prompt": "Two and two make", "completion": " four."}))
    (run,) = target_runs(instruction)
    assert tokens.tokenizer.decode(run, skip_special_tokens=False) == " four.<eos>"
    assert instruction.ids[0] == 2  # the prompt framed as Gemma frames any text: <bos>
    text = tokens.example(examples.Record("t.jsonl:1", "text", {"text": "Plain text."}))
    assert all(text.targets) and text.ids[-1] == tokens.eos_id


def test_a_template_that_rewrites_earlier_turns_is_refused(families, tmp_path):
    # renders only the last two messages: the whole is no extension of its prefixes
    rewriting = ("{% for m in messages[-2:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder = folder_with_template(families["smollm2"], tmp_path / "rewriting", rewriting)
    with pytest.raises(PymlError, match=r"chat.jsonl:7: the chat template does not render this "
                                        r"conversation's turns as prefixes of the whole"):
        tokenization(folder).example(examples.Record("chat.jsonl:7", "chat", {"messages": CONVERSATION}))


def test_a_padded_row_computes_what_the_example_alone_does():
    """Under the causal mask nothing attends to the padding after an example: the loss and every
    gradient of a padded row equal those of the example on its own (float64)."""
    llama = project_package("llama_tiny")
    model = llama.Model.initialized(seed=0, dtype=np.float64)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, llama.model.VOCAB, 9).tolist()
    example = examples.Example("x:1", ids, [False, False, False] + [True] * 6)
    rows = examples.rows([example], seq=16, pad_id=0, long_examples="truncate", packing=False)
    padded_loss = model.loss_and_grads(rows.inputs, rows.targets)
    padded_grads = model.grads.flat.copy()
    targets = np.array([[t if keep else IGNORED_TARGET for t, keep in zip(ids[1:], example.targets[1:])]])
    alone_loss = model.loss_and_grads(np.array([ids[:-1]]), targets)
    assert padded_loss == pytest.approx(alone_loss, rel=1e-12)
    np.testing.assert_allclose(padded_grads, model.grads.flat, rtol=1e-10, atol=1e-14)


def test_long_examples_are_truncated_or_dropped_and_counted():
    long = examples.Example("x:1", list(range(30)), [False] * 5 + [True] * 25)
    short = examples.Example("x:2", list(range(5)), [False, True, True, True, True])
    truncated = examples.rows([long, short], seq=10, pad_id=0, long_examples="truncate", packing=False)
    assert (truncated.truncated, truncated.dropped, len(truncated.inputs)) == (1, 0, 2)
    assert truncated.inputs[0].tolist() == list(range(10))
    assert truncated.targets[0].tolist() == [IGNORED_TARGET] * 4 + list(range(5, 11))
    assert truncated.targets[1].tolist() == [1, 2, 3, 4] + [IGNORED_TARGET] * 6
    dropped = examples.rows([long, short], seq=10, pad_id=0, long_examples="drop", packing=False)
    assert (dropped.truncated, dropped.dropped, len(dropped.inputs)) == (0, 1, 1)


BAD_DATA = {
    "not JSON": ('{"messages": [}', "bad.jsonl:1: not JSON"),
    "unknown role": (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}),
                     "bad.jsonl:1: messages[0] has role 'robot'; the roles are system, user, assistant"),
    "empty conversation": (json.dumps({"messages": []}),
                           "bad.jsonl:1: \"messages\" must be a non-empty list of messages"),
    "no assistant turn": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                          "bad.jsonl:1: no assistant turn to train on"),
    "mixed shapes": (json.dumps({"messages": CONVERSATION[1:3]}) + "\n" + json.dumps({"text": "x"}),
                     "bad.jsonl:2: a text example in a file of chat examples (bad.jsonl:1)"),
    "unknown shape": (json.dumps({"question": "?", "answer": "!"}), "bad.jsonl:1: an example is an object"),
    "window too small": ("\n".join([json.dumps({"messages": CONVERSATION})] * 3),
                         "no example fits a window of 8 tokens with a target in it"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_named_by_file_and_line_and_nothing_is_written(tiny_folders, tmp_path, case):
    content, message = BAD_DATA[case]
    (tmp_path / "bad.jsonl").write_text(content + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "pyml.cli", "train", "--spec", str(ROOT / "specs" / "llama_tiny.toml"),
         "--init", str(tiny_folders["llama"]), "--data", "bad.jsonl", "--seq", "8", "--long-examples",
         "drop", "--out", "run"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.jsonl"]


@pytest.mark.parametrize("packing", [None, False])
def test_a_tiny_chat_fine_tune_runs_end_to_end(tiny_folders, tmp_path, capsys, packing):
    """`pyml train --data chats.jsonl`: answers-only targets, a held-out share, checkpoints; the
    chats packed several to a row by default, one per row with --no-packing."""
    from pyml.train.run import train

    chats = tmp_path / "chats.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"cat {n}"},
                                      {"role": "assistant", "content": f"mat {n}"}]})
             for n in range(20)]
    chats.write_text("\n".join(lines) + "\n")
    result = train(ROOT / "specs" / "llama_tiny.toml", init=tiny_folders["llama"], data=chats, steps=2,
                   batch=2, seq=64, eval_every=1, eval_batches=1, out=tmp_path / "run", progress=False,
                   packing=packing)
    assert result.step == 2 and result.checkpoint is not None
    assert all(np.isfinite(evaluation["loss"]) for evaluation in result.evaluations)
    log = capsys.readouterr().out
    rows = int(re.search(rf"data: {re.escape(str(chats))}: 18 train examples \(\d+ target tokens\) in (\d+) "
                         r"rows, .* 0 truncated", log).group(1))
    if packing is False:
        assert rows == 18 and "packed" not in log
    else:  # a chat takes at most 32 places in the tiny byte-level vocabulary: two or more to a row
        assert rows <= 9 and "packed" in log


# A conversation in the tiny llama's alphabet (letters, digits, space, newline, full stop, comma).
TINY_CHAT = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is the capital of France"},
    {"role": "assistant", "content": "It is Paris."},
    {"role": "user", "content": "And of Italy\n\nThanks."},
    {"role": "assistant", "content": "Rome, the city of seven hills."},
]
SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt"}  # ShareGPT's names


@pytest.fixture(scope="module")
def tiny_templates(tiny_folders, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama's folder with its ChatML-like template; the tiny Gemma 3's with Gemma 3's
    instruction-tuned one (which folds the system prompt into the first user turn)."""
    root = tmp_path_factory.mktemp("tiny_templates")
    return {"llama": tiny_folders["llama"],
            "gemma3": folder_with_template(tiny_folders["gemma3"], root / "gemma3", GEMMA3_IT)}


def read_one(path: Path, line: dict) -> examples.Record:
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    (record,) = examples.read_records(path)
    return record


def same_example(got: examples.Example, want: examples.Example) -> None:
    assert (got.ids, got.targets) == (want.ids, want.targets)
    assert any(got.targets) and not all(got.targets)


# Each line, and the `messages` chat it stands for, written out by hand (not by pyml's mapping).
EQUIVALENT_CHATS = {
    "ShareGPT": ({"conversations": [{"from": SPEAKERS[m["role"]], "value": m["content"]} for m in TINY_CHAT]},
                 TINY_CHAT),
    "ShareGPT, its system prompt beside the turns": (
        {"system": TINY_CHAT[0]["content"],
         "conversations": [{"from": SPEAKERS[m["role"]], "value": m["content"]} for m in TINY_CHAT[1:]]},
        TINY_CHAT),
    "Alpaca": ({"instruction": "Name the capital.", "input": "France", "output": "Paris.",
                "system": "Answer in one word.", "text": "a formatted prompt, not trained on"},
               [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Name the capital.\nFrance"},
                {"role": "assistant", "content": "Paris."}]),
    "Alpaca, no input": ({"instruction": "Name the capital of France.", "input": "", "output": "Paris."},
                         [{"role": "user", "content": "Name the capital of France."},
                          {"role": "assistant", "content": "Paris."}]),
    "TRL conversational prompt-completion": ({"prompt": TINY_CHAT[:2], "completion": TINY_CHAT[2:3]},
                                             TINY_CHAT[:3]),
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("case", list(EQUIVALENT_CHATS))
def test_other_shapes_are_the_chats_they_stand_for(tiny_templates, tmp_path, family, case):
    """A ShareGPT, Alpaca or TRL conversational line gives the tokens and answer targets of the
    `messages` chat it stands for, rendered by the folder's own template."""
    line, messages = EQUIVALENT_CHATS[case]
    tokens = tokenization(tiny_templates[family])
    record = read_one(tmp_path / "data.jsonl", line)
    assert record.shape in examples.CHAT_SHAPES and record.shape != "chat"
    same_example(tokens.example(record), tokens.example(read_one(tmp_path / "chat.jsonl", {"messages": messages})))


def test_trl_prompt_completion_trains_on_the_completion_only(tiny_templates, tmp_path):
    """As TRL's completion-only loss: an assistant turn in the prompt is context, not a target."""
    tokens = tokenization(tiny_templates["llama"])
    record = read_one(tmp_path / "data.jsonl", {"prompt": TINY_CHAT[:4], "completion": TINY_CHAT[4:]})
    example = tokens.example(record)
    whole = tokens.example(read_one(tmp_path / "chat.jsonl", {"messages": TINY_CHAT}))
    assert example.ids == whole.ids
    decoded = [tokens.tokenizer.decode(run, skip_special_tokens=False) for run in target_runs(example)]
    assert decoded == [TINY_CHAT[4]["content"] + "<|im_end|>"]
    everything = tokenization(tiny_templates["llama"], train_on="all").example(record)
    assert all(everything.targets)


def tiny_chat_lines(count: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"cat {n}"}, {"role": "assistant", "content": f"mat {n}"}]}
            for n in range(count)]


def test_json_arrays_json_lines_in_a_json_file_and_any_case_read_as_jsonl(tiny_templates, tmp_path):
    """chats.jsonl, CHATS.JSONL, a .json array (as json.dump writes a list, indented or not) and a
    .json of JSON Lines (as datasets' to_json writes) give the same examples; each names its file
    and the line the example starts on."""
    lines = tiny_chat_lines(3)
    jsonl = "".join(json.dumps(line) + "\n" for line in lines)
    files = {"chats.jsonl": jsonl, "CHATS.JSONL": jsonl, "lines.json": jsonl,
             "array.json": json.dumps(lines, indent=2), "Array.Json": json.dumps(lines),
             "notepad.json": "\ufeff" + json.dumps(lines)}  # after the byte-order mark Notepad writes
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    tokens = tokenization(tiny_templates["llama"])
    read = {name: examples.load_examples(tmp_path / name, tokens) for name in files}
    want = [(example.ids, example.targets) for example in read["chats.jsonl"]]
    for name in files:
        assert examples.is_examples(tmp_path / name)
        assert [(example.ids, example.targets) for example in read[name]] == want, name
    starts = [number for number, line in enumerate(files["array.json"].splitlines(), start=1) if line == "  {"]
    assert [example.where for example in read["array.json"]] == [f"{tmp_path / 'array.json'}:{n}" for n in starts]
    assert [example.where for example in read["CHATS.JSONL"]] == [f"{tmp_path / 'CHATS.JSONL'}:{n}" for n in (1, 2, 3)]
    assert examples.is_examples(tmp_path) and len(examples.load_examples(tmp_path, tokens)) == 3 * len(files)


BAD_EXAMPLES = {
    "a tool turn": ({"conversations": [{"from": "human", "value": "hi"}, {"from": "tool", "value": "{}"}]},
                    "conversations[1] is from 'tool'; the speakers are human, user, gpt, assistant, system"),
    "a turn with no value": ({"conversations": [{"from": "human", "content": "hi"}]},
                             "conversations[0] must have a string \"value\""),
    "an Alpaca output that is no string": ({"instruction": "x", "output": ["y"]}, "\"output\" must be a string"),
    "a completion that is no list of messages": ({"prompt": [{"role": "user", "content": "x"}], "completion": "y"},
                                                 "\"completion\" must be a non-empty list of messages"),
    "a role TRL's prompt cannot have": ({"prompt": [{"role": "robot", "content": "x"}],
                                        "completion": [{"role": "assistant", "content": "y"}]},
                                       "prompt[0] has role 'robot'"),
}


@pytest.mark.parametrize("case", list(BAD_EXAMPLES))
def test_bad_examples_of_the_other_shapes_are_named_by_file_and_line(tmp_path, case):
    line, message = BAD_EXAMPLES[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"instruction": "fine", "output": "fine"}, line], indent=1), encoding="utf-8")
    with pytest.raises(PymlError, match=re.escape(f"{path}:6: {message}")):  # the fine item takes lines 2-5
        examples.read_records(path)


def test_a_completion_with_no_assistant_turn_is_refused(tiny_templates, tmp_path):
    record = read_one(tmp_path / "bad.jsonl", {"prompt": TINY_CHAT[:2], "completion": [TINY_CHAT[3]]})
    with pytest.raises(PymlError, match="bad.jsonl:1: no assistant turn to train on"):
        tokenization(tiny_templates["llama"]).example(record)


def pyml_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pyml.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True)


NOT_DATA = {
    "chats.csv": b"question,answer\nhi,hello\n",
    "weights.bin": bytes(range(256)),
    "chats.json": json.dumps({"messages": TINY_CHAT}, indent=2).encode(),  # one object, not one a line
    "binary.json": bytes(range(128, 256)),
}
NEITHER = "neither text (.md, .rst, .txt) nor examples (.jsonl, .json)"
REFUSALS = {
    "data": {"chats.csv": NEITHER, "weights.bin": NEITHER,
             "chats.json": "neither a JSON array of examples nor JSON Lines (one example a line)",
             "binary.json": "not UTF-8 text (byte 0)"},
    "eval-data": {"chats.csv": "examples are .jsonl or .json files (in any case), not .csv",
                  "chats.json": "neither a JSON array of examples nor JSON Lines (one example a line)"},
}


@pytest.mark.parametrize("command", ["train --data", "train --eval-data", "eval --data"])
def test_data_that_is_neither_text_nor_examples_is_refused_in_one_line(tiny_folders, tmp_path, command):
    """pyml train --data, --eval-data and pyml eval --data: a file that is neither text nor a known
    layout of examples is refused in one line that names it, before anything is written."""
    folder = tiny_folders["llama"]
    for name, content in NOT_DATA.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(line) + "\n" for line in tiny_chat_lines(4)))
    refusals = REFUSALS["eval-data" if command == "train --eval-data" else "data"]
    if command == "eval --data":
        refusals = {name: refusals[name] for name in ("chats.csv", "chats.json")}
    for name, message in refusals.items():
        if command == "eval --data":
            result = pyml_cli("eval", "--model", folder, "--data", name, "--seq", 16, cwd=tmp_path)
        else:
            data = ["--data", "chats.jsonl", "--eval-data", name] if "eval" in command else ["--data", name]
            result = pyml_cli("train", "--spec", ROOT / "specs" / "llama_tiny.toml", "--init", folder, *data,
                              "--seq", "16", "--out", "run", cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
        assert lines[0] == f"error: {name}: {message}", lines[0]
    assert not (tmp_path / "run").exists()


def test_a_sharegpt_json_array_trains_with_alpaca_jsonl_held_out_and_scores_as_pyml_eval_does(
        tiny_folders, tmp_path, capsys):
    """The layouts people download: a .json array of ShareGPT chats to train on, an upper-case
    .JSONL of Alpaca instructions held out; `pyml eval` reads the .JSONL as it reads a .jsonl."""
    from pyml.train.evaluation import evaluate_folder
    from pyml.train.run import train

    sharegpt = tmp_path / "chats.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"cat {n}"},
                                                       {"from": "gpt", "value": f"mat {n}"}]}
                                    for n in range(20)], indent=2), encoding="utf-8")
    alpaca = [{"instruction": "Say where the cat sat.", "input": f"cat {n}", "output": f"mat {n}"} for n in range(4)]
    held_out = tmp_path / "HELD_OUT.JSONL"
    held_out.write_text("".join(json.dumps(line) + "\n" for line in alpaca), encoding="utf-8")
    result = train(ROOT / "specs" / "llama_tiny.toml", init=tiny_folders["llama"], data=sharegpt, eval_data=held_out,
                   steps=1, batch=2, seq=64, eval_every=1, eval_batches=1, out=tmp_path / "run", progress=False)
    assert result.step == 1 and all(np.isfinite(evaluation["loss"]) for evaluation in result.evaluations)
    assert re.search(rf"data: {re.escape(str(sharegpt))}: 20 train examples .* 4 held out", capsys.readouterr().out)
    lower = shutil.copy(held_out, tmp_path / "held_out.jsonl")
    scored = [evaluate_folder(tiny_folders["llama"], path, seq=64, batch=1) for path in (held_out, lower)]
    assert scored[0] == scored[1] and scored[0]["examples"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_a_real_model_learns_its_chats_and_training_scores_them_as_pyml_eval_does(
        families, family, gemma3_dir, tmp_path):
    """Full fine-tuning of the real model on four chats (Gemma 3 with its instruction-tuned
    template): two batches per step and a cosine schedule, the chats held out as well, so their
    loss must fall; the run's last held-out loss is what `pyml eval` gives for its checkpoint."""
    from pyml.train.evaluation import evaluate_folder
    from pyml.train.run import train

    folder = families[family]
    if family == "gemma3":  # the template's folder, with the imported model's weights and spec
        folder = shutil.copytree(folder, tmp_path / "model")
        for name in ("source.gguf", "spec.toml"):
            (folder / name).symlink_to(gemma3_dir / name)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": CONVERSATION[:3] if n % 2 else CONVERSATION}) + "\n"
                             for n in range(4)), encoding="utf-8")
    result = train(None, init=folder, data=chats, eval_data=chats, steps=4, batch=1, accumulate=2, seq=64,
                   lr=1e-4, schedule="cosine", warmup_steps=1, eval_every=4, eval_batches=4,
                   checkpoint_every=4, out=tmp_path / "run", progress=False)
    before, after = result.evaluations[0]["loss"], result.evaluations[-1]["loss"]
    assert after < before - 0.1
    scored = evaluate_folder(result.checkpoint, chats, seq=64, batch=1)
    assert scored["loss"] == pytest.approx(after, rel=1e-6)
