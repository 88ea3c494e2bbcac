"""DPO and ORPO against TRL (trl 1.16's DPOTrainer and experimental ORPOTrainer) on Hugging Face's
LlamaForCausalLM of the same tiny model folder, float64: the same pairs in the same batches, three
AdamW steps, and at each step the loss, every metric TRL logs and every trainable gradient to 1e-10;
with full weights and with LoRA (peft, the reference being the base with the adapters off).

TRL computes two things in float32 whatever the model's dtype: DPO's fused LM head (its chunked
log-softmax) and ORPO's odds ratio (`.float()` on the log-probabilities). For a float64 reference
the test runs the same arithmetic in the model's dtype (`float64_trl`), as tests/support/hf_reference
does for transformers' RMSNorm and rotary tables."""

import json

import numpy as np
import pytest
import torch

from pyml.formats.stored_tensors import stored_weights
from pyml.packages import package_for
from pyml.train.examples import Tokenization
from pyml.train.folder_data import FolderTokens
from pyml.train.lora import PEFT_MODULES, lora_settings, lora_spec
from pyml.train.preference import (
    PAIR_METRICS,
    Objective,
    pair_rows,
    preference_loss_and_grads,
    read_pairs,
    with_reference,
)
from tests.support.generator_fuzz import relative_error
from tests.support.hf_reference import llama_in_float64
from tests.support.model_folders import transformers_folder

QUESTIONS = [  # short: the tiny model's tokens are characters, its max_seq_len 64
    ("Capital of France?", "Paris.", "Rome, in May."),
    ("Legs of a cat?", "Four.", "Twelve."),
    ("Seven and five?", "Twelve.", "The rivers."),
    ("Where sat the cat?", "On the mat.", "In a field."),
    ("What runs high?", "The rivers.", "A cat."),
    ("Capital of Italy?", "Rome.", "Paris, sun."),
]
PAIRS_PER_STEP, STEPS = 2, 3
SETTINGS = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
LORA_TARGETS = ["q", "v", "o", "gate", "down"]
TOLERANCE = 1e-10


class LogProbsInModelDtype:
    """TRL's chunked fused LM head (`trl.kernels.ChunkedLogProbFunction`: log-probabilities of
    the labels, entropy, mean logits, top-1 hits), unchunked and in the hidden states' dtype."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        assert softcap is None and bias is None
        logits = hidden @ weight.t() * logit_scale / temperature
        log_softmax = torch.log_softmax(logits, dim=-1)
        log_probs = log_softmax.gather(-1, labels[:, None]).squeeze(-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        return log_probs, entropy.detach(), None, logits.mean(-1).detach(), logits.argmax(-1) == labels


def odds_ratio_loss_in_model_dtype(self, policy_chosen_logps, policy_rejected_logps):
    """trl.experimental.orpo.ORPOTrainer.odds_ratio_loss without its casts to float32."""
    from trl.experimental.orpo.orpo_trainer import log1mexp

    log_odds = (policy_chosen_logps - policy_rejected_logps) - (
        log1mexp(policy_chosen_logps) - log1mexp(policy_rejected_logps))
    ratio = torch.nn.functional.logsigmoid(log_odds)
    return (self.beta * ratio, self.beta * policy_chosen_logps.detach(), self.beta * policy_rejected_logps.detach(),
            torch.mean(ratio), torch.mean(log_odds))


@pytest.fixture
def float64_trl(monkeypatch):
    from trl.experimental.orpo import ORPOTrainer

    monkeypatch.setattr("trl.trainer.utils._ChunkedLogProbFunction", LogProbsInModelDtype)
    monkeypatch.setattr(ORPOTrainer, "odds_ratio_loss", odds_ratio_loss_in_model_dtype)


def conversational_pairs(path):
    lines = [{"prompt": [{"role": "user", "content": question}],
              "chosen": [{"role": "assistant", "content": chosen}],
              "rejected": [{"role": "assistant", "content": rejected}]}
             for question, chosen, rejected in QUESTIONS]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path, lines


def our_pairs(folder, data, vocab):
    tokens = FolderTokens(folder, vocab, "test")
    pairs, skips = read_pairs(data, Tokenization(tokens.tokenizer, tokens.template, tokens.eos_id, "assistant"))
    assert skips.same_answers == skips.empty_answers == 0
    rows, too_long = pair_rows(pairs, 64, tokens.pad_id)
    assert too_long == 0
    return pairs, rows


def our_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".default", "")


def pyml_model(folder, lora: bool):
    if lora:
        _, package = lora_spec(folder / "spec.toml", lora_settings(4, 12.0, LORA_TARGETS))
        return package, package.Model.from_base(folder, seed=1, dtype=np.float64)
    package = package_for(folder / "spec.toml")
    model = package.Model(dtype=np.float64)
    model.load_tensors(*stored_weights(folder, "float64"))
    return package, model


def hf_policy(folder, monkeypatch):
    """The folder's LlamaForCausalLM in float64, its input embedding trained on every row: torch's
    padding_idx (config.pad_token_id, here <|im_end|>, a token of every chat) would leave that
    row's input-side gradient out, where pyml, as the model's arithmetic, counts it."""
    model = llama_in_float64(folder, monkeypatch)
    model.model.embed_tokens.padding_idx = None
    return model


def trainable_of(trainer):
    return {our_name(name): param for name, param in trainer.model.named_parameters() if param.requires_grad}


def copy_adapters(model, trainer):
    """pyml's initial adapters (A drawn, B zero) into peft's."""
    adapters = model.adapter_tensors()
    with torch.no_grad():
        for name, param in trainable_of(trainer).items():
            param.copy_(torch.tensor(adapters[name]))


def dpo_trainer(folder, data_lines, monkeypatch, tmp_path, loss_type, lora):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    policy = hf_policy(folder, monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(transformers_folder(folder))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), learning_rate=SETTINGS["lr"], beta=0.1,
                     loss_type=[loss_type], bf16=False, gradient_checkpointing=False, report_to=[],
                     max_length=None, use_cpu=True, per_device_train_batch_size=PAIRS_PER_STEP)
    options = {}
    if lora:
        options["peft_config"] = LoraConfig(r=4, lora_alpha=12.0, lora_dropout=0.0, bias="none",
                                            target_modules=[PEFT_MODULES[t] for t in LORA_TARGETS])
    else:
        options["ref_model"] = llama_in_float64(folder, monkeypatch)
    return DPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(data_lines),
                      processing_class=tokenizer, **options)


def compare_steps(package, model, objective, rows, trl_loss_and_metrics, trainer, lora):
    """STEPS AdamW steps of both, each on the next PAIRS_PER_STEP pairs; returns the largest
    relative error seen in the losses, metrics and gradients."""
    ours = package.AdamW(model, **SETTINGS)
    trainable = trainable_of(trainer)
    theirs = torch.optim.AdamW(list(trainable.values()), **SETTINGS)
    worst = 0.0
    for step in range(STEPS):
        chosen = list(range(step * PAIRS_PER_STEP, (step + 1) * PAIRS_PER_STEP))
        theirs.zero_grad()
        loss, metrics = trl_loss_and_metrics(chosen)
        loss.backward()
        ours_step = preference_loss_and_grads(model, rows.take(chosen), objective)
        assert ours_step.loss == pytest.approx(loss.item(), rel=TOLERANCE, abs=TOLERANCE)
        for name, value in ours_step.metrics().items():
            assert value == pytest.approx(metrics[name], rel=TOLERANCE, abs=TOLERANCE), (step, name)
        grads = model.tensors(package.Parameters(model.grads.flat))
        for name, param in trainable.items():
            if name == "lm_head.weight":  # tied: its gradient is in the embedding's
                continue
            error = relative_error(grads[name], param.grad.numpy())
            assert error < TOLERANCE, (step, name, error)
            worst = max(worst, error)
        theirs.step()
        ours.step()
    after = model.adapter_tensors() if lora else model.host_tensors()
    for name, param in trainable.items():
        if name != "lm_head.weight":
            assert relative_error(after[name], param.detach().numpy()) < TOLERANCE, name
    return worst


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_equals_trl(tiny_folders, tmp_path, monkeypatch, float64_trl, loss_type, lora):
    folder = tiny_folders["llama"]
    data, lines = conversational_pairs(tmp_path / "pairs.jsonl")
    package, model = pyml_model(folder, lora)
    pairs, rows = our_pairs(folder, data, package.Model.VOCAB)
    trainer = dpo_trainer(folder, lines, monkeypatch, tmp_path, loss_type, lora)
    # the same tokens as TRL's: prompt, chosen and rejected answers
    for pair, example in zip(pairs, trainer.train_dataset, strict=True):
        assert (pair.prompt, pair.chosen, pair.rejected) == (
            example["prompt_ids"], example["chosen_ids"], example["rejected_ids"])
    if lora:
        copy_adapters(model, trainer)
    objective = Objective("dpo", 0.1, loss_type)
    rows = with_reference(rows, model.target_log_probs, PAIRS_PER_STEP)
    trainer.model.train()

    def trl_loss_and_metrics(chosen):
        batch = trainer.data_collator([trainer.train_dataset[index] for index in chosen])
        loss = trainer.compute_loss(trainer.model, batch)
        return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}

    compare_steps(package, model, objective, rows, trl_loss_and_metrics, trainer, lora)


def orpo_batch(pairs, pad_id):
    """TRL ORPO's batch of our pairs: prompt + answer ids, the answers as labels, right-padded."""
    batch = {}
    for side in ("chosen", "rejected"):
        sequences = [pair.prompt + getattr(pair, side) for pair in pairs]
        width = max(len(ids) for ids in sequences)
        batch[f"{side}_input_ids"] = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids in sequences])
        batch[f"{side}_attention_mask"] = torch.tensor([[1] * len(ids) + [0] * (width - len(ids))
                                                        for ids in sequences])
        batch[f"{side}_labels"] = torch.tensor([[-100] * len(pair.prompt) + getattr(pair, side)
                                                + [-100] * (width - len(ids))
                                                for pair, ids in zip(pairs, sequences)])
    return batch


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_orpo_equals_trl(tiny_folders, tmp_path, monkeypatch, float64_trl, lora):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    folder = tiny_folders["llama"]
    data, lines = conversational_pairs(tmp_path / "pairs.jsonl")
    package, model = pyml_model(folder, lora)
    pairs, rows = our_pairs(folder, data, package.Model.VOCAB)
    policy = hf_policy(folder, monkeypatch)
    if lora:
        policy = get_peft_model(policy, LoraConfig(r=4, lora_alpha=12.0, lora_dropout=0.0, bias="none",
                                                   target_modules=[PEFT_MODULES[t] for t in LORA_TARGETS]))
    tokenizer = AutoTokenizer.from_pretrained(transformers_folder(folder))
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), learning_rate=SETTINGS["lr"], beta=0.1, bf16=False,
                      report_to=[], use_cpu=True, per_device_train_batch_size=PAIRS_PER_STEP)
    trainer = ORPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(lines),
                          processing_class=tokenizer)
    if lora:
        copy_adapters(model, trainer)
    trainer.model.train()
    pad_id = FolderTokens(folder, package.Model.VOCAB, "test").pad_id

    def trl_loss_and_metrics(chosen):
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, orpo_batch([pairs[i] for i in chosen], pad_id))
        return loss, metrics

    compare_steps(package, model, Objective("orpo", 0.1), rows, trl_loss_and_metrics, trainer, lora)



def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def dpo_training(folder, data, eval_data, out, **options):
    from pyml.train.run import train

    values = dict(steps=4, batch=2, seq=64, lr=1e-3, eval_every=2, checkpoint_every=2, dtype="float64",
                  schedule="constant", method="dpo")
    return train(None, init=folder, data=data, eval_data=eval_data, out=out, progress=False,
                 **(values | options))


def test_a_dpo_run_logs_trls_metrics_resumes_bit_identically_and_evaluates_as_pyml_eval(tiny_folders, tmp_path):
    from pyml.train.evaluation import evaluate_pairs_folder

    folder = tiny_folders["llama"]
    data, lines = conversational_pairs(tmp_path / "pairs.jsonl")
    held_out = write_lines(tmp_path / "held_out.jsonl", lines[:2])
    whole = dpo_training(folder, data, held_out, tmp_path / "whole")
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4]
    assert all(set(PAIR_METRICS) <= set(record) for record in steps)
    evaluations = [record for record in records if "held_out_loss" in record]
    assert all({f"held_out_{name}" for name in PAIR_METRICS} <= set(record) for record in evaluations)
    assert evaluations[0]["held_out_loss"] == pytest.approx(np.log(2), rel=1e-12)  # the model is its reference
    assert whole.train_losses[-1] < whole.train_losses[0]

    dpo_training(folder, data, held_out, tmp_path / "resumed", steps=2)
    resumed = dpo_training(folder, data, held_out, tmp_path / "resumed", resume=True)
    assert resumed.train_losses == whole.train_losses
    assert resumed.evaluations == whole.evaluations

    scored = evaluate_pairs_folder(whole.checkpoint, held_out, Objective("dpo"), reference=folder, seq=64,
                                   dtype="float64")
    for name in ("loss", *PAIR_METRICS):
        assert scored[name] == pytest.approx(whole.evaluations[-1][name], rel=1e-10, abs=1e-12), name


def test_accumulated_slices_of_pairs_give_the_whole_batchs_gradient(tiny_folders, tmp_path):
    folder = tiny_folders["llama"]
    data, _ = conversational_pairs(tmp_path / "pairs.jsonl")
    for objective in (Objective("dpo"), Objective("dpo", 0.1, "ipo"), Objective("orpo")):
        package, model = pyml_model(folder, lora=False)
        _, rows = our_pairs(folder, data, package.Model.VOCAB)
        rows = with_reference(rows, model.target_log_probs, 3).take([0, 1, 2, 3])
        # the reference is the model itself: move the weights so that the losses are not all log 2
        model.params.flat[:] += np.random.default_rng(0).normal(0.0, 0.01, model.params.flat.shape)
        whole = preference_loss_and_grads(model, rows, objective)
        whole_grads = model.grads.flat.copy()
        sliced = preference_loss_and_grads(model, rows, objective, slices=3)
        assert sliced.loss == pytest.approx(whole.loss, rel=1e-12)
        assert sliced.metrics() == pytest.approx(whole.metrics(), rel=1e-12)
        assert relative_error(model.grads.flat, whole_grads) < 1e-12, objective


def test_bad_pairs_are_named_counted_or_refused(tiny_folders, tmp_path):
    from pyml.errors import PymlError
    from pyml.train.preference import load_pairs

    folder = tiny_folders["llama"]
    tokens = FolderTokens(folder, 96, "test")
    user = [{"role": "user", "content": "Hi?"}]
    good = {"prompt": user, "chosen": [{"role": "assistant", "content": "Hello."}],
            "rejected": [{"role": "assistant", "content": "Go."}]}
    same = good | {"rejected": good["chosen"]}
    empty = good | {"chosen": [{"role": "assistant", "content": " "}]}
    pairs, skips = load_pairs(write_lines(tmp_path / "a.jsonl", [good, same, empty, good]), tokens)
    assert (len(pairs), skips.same_answers, skips.empty_answers) == (2, 1, 1)
    long = good | {"chosen": [{"role": "assistant", "content": "x" * 80}]}
    _, too_long = pair_rows(load_pairs(write_lines(tmp_path / "b.jsonl", [good, long]), tokens)[0], 64,
                            tokens.pad_id)
    assert too_long == 1
    refusals = {
        "c.jsonl": ([good, {"prompt": "Hi?", "chosen": "a"}], "c.jsonl:2: a preference pair is an object"),
        "d.jsonl": ([good, {"prompt": "Hi?", "chosen": "a", "rejected": "b"}], "d.jsonl:2: a text pair in a file of conversational"),
        "e.jsonl": ([{"prompt": user, "chosen": "a", "rejected": "b"}], "e.jsonl:1: \"prompt\", \"chosen\" and \"rejected\" must all be"),
        "f.jsonl": ([good | {"chosen": [{"role": "robot", "content": "a"}]}], "f.jsonl:1: chosen[0] has role 'robot'"),
    }
    for name, (values, message) in refusals.items():
        with pytest.raises(PymlError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_pairs(write_lines(tmp_path / name, values), tokens)
    (tmp_path / "g.jsonl").write_text(json.dumps(good) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(PymlError, match="g.jsonl:2: not JSON"):
        load_pairs(tmp_path / "g.jsonl", tokens)


def test_text_pairs_end_with_the_end_of_text_token_as_trls(tiny_folders, tmp_path):
    from pyml.train.preference import load_pairs

    folder = tiny_folders["llama"]
    tokens = FolderTokens(folder, 96, "test")
    pairs, _ = load_pairs(write_lines(tmp_path / "t.jsonl", [{"prompt": "Seven and five", "chosen": " Twelve.",
                                                              "rejected": " Ten."}]), tokens)
    (pair,) = pairs
    assert pair.chosen[-1] == pair.rejected[-1] == tokens.eos_id
    assert tokens.tokenizer.decode(pair.prompt + pair.chosen[:-1]) == "Seven and five Twelve."


@pytest.mark.parametrize("options, message", [
    ({"method": "ppo"}, "--method must be one of sft, dpo, orpo, not 'ppo'"),
    ({"beta": 0.2}, "--beta and --loss-type set a preference loss: give --method dpo or orpo"),
    ({"method": "orpo", "loss_type": "ipo"}, "--loss-type chooses DPO's loss; ORPO has its own"),
    ({"method": "dpo", "loss_type": "hinge"}, "--loss-type must be one of sigmoid, ipo, not 'hinge'"),
    ({"method": "dpo", "beta": 0.0}, "--beta must be a positive number"),
    ({"method": "dpo", "train_on": "all"}, "--train-on shapes SFT examples; --method dpo trains on pairs"),
])  # fmt: skip
def test_bad_preference_options_are_refused_before_training(tiny_folders, tmp_path, options, message):
    from pyml.errors import PymlError
    from pyml.train.run import train

    data, _ = conversational_pairs(tmp_path / "pairs.jsonl")
    with pytest.raises(PymlError, match=message):
        train(None, init=tiny_folders["llama"], data=data, out=tmp_path / "run", progress=False, **options)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
