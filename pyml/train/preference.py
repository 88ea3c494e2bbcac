"""Preference tuning: DPO and ORPO on pairs of answers to one prompt, computed as TRL computes them
(trl 1.16: `DPOTrainer`, `experimental.orpo.ORPOTrainer`).

Data (`--data`, JSONL or JSON, one shape per file, TRL's two shapes):

    {"prompt": "...", "chosen": "...", "rejected": "..."}                       text
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}        conversational

tokenised as TRL's DPOTrainer tokenises them: a conversation's prompt is rendered with the folder's
chat template and the generation prompt, prompt + answer without it, and the answer's tokens are
those past the longest prefix the prompt shares with both renderings (everything the template
writes after the generation prompt, its end-of-turn token and what follows it included); a text
answer gets the end-of-text token appended, as TRL's `add_eos` does.

Each pair is two rows of the batch: the chosen sequences of the batch's pairs first, then the
rejected ones, as TRL's collator concatenates them; so chosen and rejected go through the model in
one forward pass and never attend to each other. A sequence's log-probability is the sum of its
answer tokens' log-probabilities. The losses, per pair, with c and r the chosen and rejected
sequences, pi the trained model, ref the reference:

    DPO sigmoid  -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))
    DPO ipo      (h - 1 / (2 beta))^2,  h = (log pi(c) - log ref(c)) / |c| - (log pi(r) - log ref(r)) / |r|
                 (TRL normalises by the answers' token counts, as the IPO authors confirmed to it)
    ORPO         -beta * log sigmoid(log odds(a_c) - log odds(a_r)), a = the mean log-probability
                 of the answer's tokens, odds(a) = e^a / (1 - e^a); plus the chosen sequence's
                 cross-entropy, which TRL's ORPO takes over the whole sequence, prompt included,
                 averaged over the tokens of the batch's chosen sequences.

The batch's loss is the mean over its pairs. Every one of these is a function of the sequences'
log-probabilities S, which are sums of the answer tokens' -cross-entropy, so its gradient with
respect to the logits is each token's cross-entropy gradient times -dL/dS of its sequence: one
forward, the per-token log-probabilities read from its logits, these closed forms, and one
backward with those weights (`DecoderModel.loss_and_grads(token_weights=...)`).

The reference (DPO): the model as it was before the first step, its log-probabilities computed once
over the training and held-out pairs before training and kept in the run folder, so a resume reuses
them. With LoRA that is the base with the adapters off, what TRL's DPOTrainer uses with peft, since
B starts at zero and adding a zero update leaves every activation as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.package.cpu.loss import IGNORED_TARGET
from pyml.train import examples

METHODS = ("sft", "dpo", "orpo")
LOSS_TYPES = ("sigmoid", "ipo")
DEFAULT_BETA = 0.1  # TRL's DPOConfig.beta and ORPOConfig.beta (ORPO's lambda)
# a DPO run's reference log-probabilities of its training and held-out pairs, in its --out folder
REFERENCE_FILE = "reference_log_probs.npz"
PAIR_SHAPES = ("text", "conversational")
# what TRL logs of a preference step, in its order; the means over the batch's pairs
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class Objective:
    """What a preference run minimises: `method` dpo or orpo, `beta` (DPO's temperature, ORPO's
    lambda), and DPO's `loss_type`."""

    method: str
    beta: float = DEFAULT_BETA
    loss_type: str = "sigmoid"

    def __post_init__(self):
        if self.method not in ("dpo", "orpo"):
            raise PymlError(f"--method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise PymlError(f"--beta must be a positive number, got {self.beta}")
        if self.loss_type not in LOSS_TYPES:
            raise PymlError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, not {self.loss_type!r}")
        if self.method == "orpo" and self.loss_type != "sigmoid":
            raise PymlError("--loss-type chooses DPO's loss; ORPO has its own: leave it out")

    @property
    def uses_reference(self) -> bool:
        return self.method == "dpo"


@dataclass(frozen=True)
class Pair:
    where: str  # file:line
    prompt: list[int]  # the tokens the two sequences share
    chosen: list[int]  # the chosen answer's tokens, after the prompt
    rejected: list[int]


@dataclass(frozen=True)
class PairSkips:
    """Pairs read but not trained on, by reason; each count is said in the data line."""

    same_answers: int = 0  # chosen equals rejected: no preference to learn
    empty_answers: int = 0

    def __add__(self, other: PairSkips) -> PairSkips:
        return PairSkips(self.same_answers + other.same_answers, self.empty_answers + other.empty_answers)

    def describe(self, too_long: int) -> str:
        return (f"skipped {self.same_answers} with chosen equal to rejected, {self.empty_answers} with "
                f"an empty answer, {too_long} longer than --seq")


def pair_shape(value: object, where: str) -> str:
    """"text" or "conversational", or a one-line error naming the line."""
    keys = ("prompt", "chosen", "rejected")
    if not isinstance(value, dict) or any(key not in value for key in keys):
        raise PymlError(f"{where}: a preference pair is an object with \"prompt\", \"chosen\" and "
                        "\"rejected\" (texts, or lists of messages)")
    if all(isinstance(value[key], str) for key in keys):
        return "text"
    if all(isinstance(value[key], list) for key in keys):
        for key in keys:
            if value[key]:
                examples.messages_of(value, key, where)
        if not value["prompt"]:
            raise PymlError(f"{where}: \"prompt\" must be a non-empty list of messages")
        return "conversational"
    raise PymlError(f"{where}: \"prompt\", \"chosen\" and \"rejected\" must all be texts or all be "
                    "lists of messages")


def common_prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def tokenized_pair(value: dict, shape: str, where: str, tokenization: examples.Tokenization) -> Pair:
    """A pair's tokens as TRL's DPOTrainer makes them (`_prepare_dataset`'s tokenize_fn)."""
    encode = tokenization.encode
    if shape == "conversational":
        template = tokenization.template
        if template is None:
            raise PymlError(f"{where}: a conversational pair needs the model folder's chat template, "
                            "and this folder has none (a base model): give text pairs")
        prompt = encode(template.render(value["prompt"], add_generation_prompt=True))
        chosen, rejected = (encode(template.render(value["prompt"] + value[key], add_generation_prompt=False))
                            for key in ("chosen", "rejected"))
    else:
        eos = tokenization.tokenizer.id_to_token(tokenization.eos_id)
        prompt = encode(value["prompt"], framed=True)
        chosen, rejected = (encode(value["prompt"] + (value[key] if value[key].endswith(eos) else value[key] + eos),
                                   framed=True) for key in ("chosen", "rejected"))
    shared = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
    return Pair(where, prompt[:shared], chosen[shared:], rejected[shared:])


def is_empty(answer) -> bool:
    if isinstance(answer, str):
        return not answer.strip()
    return not answer or all(not message["content"].strip() for message in answer)


def read_pairs(data: Path, tokenization: examples.Tokenization) -> tuple[list[Pair], PairSkips]:
    """The pairs of `data` (a file or a folder of .jsonl/.json files), and those skipped."""
    pairs, same, empty = [], 0, 0
    for path in examples.example_files(Path(data)):
        values = examples.read_values(path)
        if not values:
            raise PymlError(f"{path}: holds no pairs")
        first_where, first_shape = values[0][0], pair_shape(values[0][1], values[0][0])
        for where, value in values:
            shape = pair_shape(value, where)
            if shape != first_shape:
                raise PymlError(f"{where}: a {shape} pair in a file of {first_shape} pairs "
                                f"({first_where}): one shape per file")
            if is_empty(value["chosen"]) or is_empty(value["rejected"]):
                empty += 1
                continue
            if value["chosen"] == value["rejected"]:
                same += 1
                continue
            pairs.append(tokenized_pair(value, shape, where, tokenization))
    return pairs, PairSkips(same, empty)


def load_pairs(data: Path, tokens) -> tuple[list[Pair], PairSkips]:
    """`read_pairs` with a model folder's tokens (`pyml.train.folder_data.FolderTokens`)."""
    return read_pairs(data, examples.Tokenization(tokens.tokenizer, tokens.template, tokens.eos_id, "assistant"))


@dataclass(frozen=True)
class PairRows:
    """Pairs as aligned arrays (one row per pair, `seq` places a sequence), so that `Batches` draws
    pairs. Targets are every next token of a sequence (IGNORED_TARGET past its end); `*_answers`
    marks the targets that are answer tokens. The reference log-probabilities are NaN until
    `with_reference` fills them (and stay so for ORPO)."""

    chosen_inputs: np.ndarray  # (P, seq) int64
    chosen_targets: np.ndarray  # (P, seq) int64
    chosen_answers: np.ndarray  # (P, seq) bool
    rejected_inputs: np.ndarray
    rejected_targets: np.ndarray
    rejected_answers: np.ndarray
    reference_chosen: np.ndarray  # (P,) float64: the reference's log-probability of the chosen answer
    reference_rejected: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, field.name) for field in fields(self))

    @property
    def pairs(self) -> int:
        return len(self.chosen_inputs)

    def take(self, rows) -> PairRows:
        return PairRows(*(array[rows] for array in self.arrays()))


def pair_rows(pairs: list[Pair], seq: int, pad_id: int) -> tuple[PairRows, int]:
    """(the pairs that fit `seq`, as rows; how many did not): a sequence of n tokens takes n - 1
    places, as an SFT example does."""
    fitting = [pair for pair in pairs
               if max(len(pair.chosen), len(pair.rejected)) + len(pair.prompt) - 1 <= seq]
    count = len(fitting)
    arrays = []
    for side in ("chosen", "rejected"):
        inputs = np.full((count, seq), pad_id, dtype=np.int64)
        targets = np.full((count, seq), IGNORED_TARGET, dtype=np.int64)
        answers = np.zeros((count, seq), dtype=bool)
        for row, pair in enumerate(fitting):
            ids = pair.prompt + getattr(pair, side)
            inputs[row, : len(ids) - 1] = ids[:-1]
            targets[row, : len(ids) - 1] = ids[1:]
            # the answer's tokens as targets (a first token with no prompt before it is not predicted, as in TRL)
            answers[row, max(len(pair.prompt) - 1, 0) : len(ids) - 1] = True
        arrays += [inputs, targets, answers]
    missing = np.full(count, np.nan)
    return PairRows(*arrays, missing, missing.copy()), len(pairs) - count


def sequence_rows(batch: PairRows, objective: Objective) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, answers), (2P, seq) each: the chosen sequences, then the rejected ones.
    Only the tokens the loss reads are targets (the answers; ORPO also the chosen prompts)."""
    inputs = np.concatenate([batch.chosen_inputs, batch.rejected_inputs])
    answers = np.concatenate([batch.chosen_answers, batch.rejected_answers])
    read = answers.copy()
    if objective.method == "orpo":
        read[: batch.pairs] = batch.chosen_targets != IGNORED_TARGET
    targets = np.where(read, np.concatenate([batch.chosen_targets, batch.rejected_targets]), IGNORED_TARGET)
    return inputs, targets, answers


def log1mexp(x: np.ndarray) -> np.ndarray:
    """log(1 - e^x) for x < 0, by the branch that keeps its precision (as TRL's ORPO)."""
    return np.where(x < -math.log(2), np.log1p(-np.exp(np.minimum(x, -math.log(2)))),
                    np.log(-np.expm1(np.maximum(x, -math.log(2)))))


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(x))


@dataclass(frozen=True)
class PairTerms:
    """Per pair: its loss, d loss / d the chosen and rejected sequences' summed log-probabilities,
    and what TRL logs of it."""

    losses: np.ndarray
    d_chosen: np.ndarray
    d_rejected: np.ndarray
    chosen_rewards: np.ndarray
    rejected_rewards: np.ndarray
    chosen_logps: np.ndarray  # as logged: DPO's sums, ORPO's per-token means
    rejected_logps: np.ndarray


def pair_terms(objective: Objective, chosen: np.ndarray, rejected: np.ndarray, chosen_tokens: np.ndarray,
               rejected_tokens: np.ndarray, reference_chosen: np.ndarray,
               reference_rejected: np.ndarray) -> PairTerms:
    """The losses of pairs whose answers' summed log-probabilities are `chosen` and `rejected`
    ((P,) float64) over `*_tokens` answer tokens, and their closed-form derivatives."""
    beta = objective.beta
    if objective.method == "orpo":
        chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
        log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
        # d/da [-beta log sigmoid(log odds)] with d log odds / d a_c = 1 / (1 - e^a_c), and / tokens for the sum
        push = -beta * sigmoid(-log_odds)
        return PairTerms(-beta * log_sigmoid(log_odds),
                         push / -np.expm1(chosen_mean) / chosen_tokens,
                         -push / -np.expm1(rejected_mean) / rejected_tokens,
                         beta * chosen_mean, beta * rejected_mean, chosen_mean, rejected_mean)
    chosen_ratio, rejected_ratio = chosen - reference_chosen, rejected - reference_rejected
    if objective.loss_type == "sigmoid":
        margin = beta * (chosen_ratio - rejected_ratio)
        losses = -log_sigmoid(margin)
        d_margin = -beta * sigmoid(-margin)
        d_chosen, d_rejected = d_margin, -d_margin
    else:  # ipo, on the per-token log-ratios
        gap = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1.0 / (2.0 * beta)
        losses = gap**2
        d_chosen, d_rejected = 2.0 * gap / chosen_tokens, -2.0 * gap / rejected_tokens
    return PairTerms(losses, d_chosen, d_rejected, beta * chosen_ratio, beta * rejected_ratio,
                     chosen, rejected)


@dataclass
class PreferenceStep:
    """What one step over a batch of pairs gives: the loss (the mean over pairs, ORPO's chosen
    cross-entropy added) and, per pair, the values its metrics are means of."""

    loss: float
    terms: list[PairTerms]

    def metrics(self) -> dict[str, float]:
        return pair_metrics(self.terms)


def pair_metrics(terms: list[PairTerms]) -> dict[str, float]:
    """TRL's logged means over the pairs of `terms`."""
    chosen, rejected = (np.concatenate([getattr(term, name) for term in terms])
                        for name in ("chosen_rewards", "rejected_rewards"))
    values = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": np.concatenate([term.chosen_logps for term in terms]).mean(),
        "logps/rejected": np.concatenate([term.rejected_logps for term in terms]).mean(),
    }
    return {name: float(value) for name, value in values.items()}


def answer_sums(log_probs: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """Each sequence's log-probability: the sum over its answer tokens, in order."""
    return np.where(answers, log_probs, 0.0).sum(axis=1)


class SliceLoss:
    """The token weights of one slice of pairs (`DecoderModel.loss_and_grads(token_weights=...)`):
    called with the slice's per-token log-probabilities, it keeps the slice's pair terms and its
    share of the loss, and returns d loss / d each token's cross-entropy."""

    def __init__(self, rows: PairRows, objective: Objective, pair_total: int, token_total: int):
        self.rows, self.objective = rows, objective
        self.pair_total, self.token_total = pair_total, token_total
        self.inputs, self.targets, self.answers = sequence_rows(rows, objective)
        self.loss, self.terms = 0.0, None

    def __call__(self, log_probs: np.ndarray) -> np.ndarray:
        half, answers = self.rows.pairs, self.answers
        sums, counts = answer_sums(log_probs, answers), answers.sum(axis=1)
        self.terms = pair_terms(self.objective, sums[:half], sums[half:], counts[:half], counts[half:],
                                self.rows.reference_chosen, self.rows.reference_rejected)
        self.loss = float(self.terms.losses.sum()) / self.pair_total
        d_sums = np.concatenate([self.terms.d_chosen, self.terms.d_rejected]) / self.pair_total
        weights = np.where(answers, -d_sums[:, None], 0.0)  # d loss / d CE = -d loss / d log p
        if self.objective.method == "orpo":  # + the chosen sequences' mean cross-entropy
            read = self.targets[:half] != IGNORED_TARGET
            self.loss -= float(np.where(read, log_probs[:half], 0.0).sum()) / self.token_total
            weights[:half] += read / self.token_total
        return weights


def chosen_token_count(batch: PairRows) -> int:
    """The targets of the batch's chosen sequences: what ORPO's cross-entropy is the mean over."""
    return int(np.count_nonzero(batch.chosen_targets != IGNORED_TARGET))


def preference_loss_and_grads(model, batch: PairRows, objective: Objective, slices: int = 1,
                              on_grads_ready=None, totals: tuple[int, int] | None = None) -> PreferenceStep:
    """The batch's preference loss, its gradient in `model.grads`, one forward and one backward per
    slice of pairs (`slices` > 1: gradient accumulation, the slices' gradients summed). Each pair
    weighs 1 / (the batch's pairs), ORPO's cross-entropy 1 / (the batch's chosen tokens), so the
    slices sum to the whole batch's loss and gradient; with several ranks `batch` is this rank's
    share and `totals` (pairs, chosen tokens) the whole batch's, so that the ranks' sum is it."""
    pairs, chosen_tokens = totals or (batch.pairs, chosen_token_count(batch))
    bounds = [batch.pairs * index // slices for index in range(slices + 1)]
    parts = [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    loss, terms = 0.0, []
    for number, part in enumerate(parts):
        slice_loss = SliceLoss(batch.take(part), objective, pairs, chosen_tokens)
        hook = on_grads_ready if len(parts) == 1 else None
        model.loss_and_grads(slice_loss.inputs, slice_loss.targets, hook, token_weights=slice_loss)
        loss += slice_loss.loss
        terms.append(slice_loss.terms)
        if len(parts) > 1:
            accumulate_grads(model, number == 0, number == len(parts) - 1, on_grads_ready)
    return PreferenceStep(loss, terms)


def accumulate_grads(model, first: bool, last: bool, on_grads_ready) -> None:
    """Sum each slice's gradient (already weighted for the whole batch) into one buffer; after
    the last, that sum is `model.grads`."""
    kernels, grads = model.device.kernels, model.grads.flat
    accumulated = getattr(model, "accumulated_grads", None)  # allocated at the first such step
    if accumulated is None:
        accumulated = model.accumulated_grads = model.device.zeros(grads.shape[0])
    if first:
        kernels.copy_into(accumulated, grads)
    else:
        kernels.add_into(accumulated, grads)
    if last:
        kernels.copy_into(grads, accumulated)
        if on_grads_ready is not None:
            for bucket in range(len(model.grad_buckets)):
                on_grads_ready(bucket)


def preference_step(model, optimizer, batch: PairRows, objective: Objective, slices: int = 1) -> PreferenceStep:
    """One optimizer step on a batch of pairs; a non-finite loss leaves the weights as they were."""
    step = preference_loss_and_grads(model, batch, objective, slices)
    if not math.isfinite(step.loss):
        raise PymlError(f"non-finite loss ({step.loss}) at optimizer step {optimizer.step_count + 1}; "
                        "weights left unchanged")
    optimizer.step()
    return step


def sequence_log_probs(score, batch: PairRows, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) summed answer log-probabilities ((P,) float64 each) under `score`
    (input ids, targets) -> each target's log-probability, `batch_size` pairs at a time."""
    chosen, rejected = [], []
    for start in range(0, batch.pairs, batch_size):
        rows = batch.take(slice(start, start + batch_size))
        inputs = np.concatenate([rows.chosen_inputs, rows.rejected_inputs])
        answers = np.concatenate([rows.chosen_answers, rows.rejected_answers])
        targets = np.where(answers, np.concatenate([rows.chosen_targets, rows.rejected_targets]),
                           IGNORED_TARGET)
        sums = answer_sums(score(inputs, targets), answers)
        chosen.append(sums[: rows.pairs])
        rejected.append(sums[rows.pairs :])
    return np.concatenate(chosen), np.concatenate(rejected)


def with_reference(batch: PairRows, score, batch_size: int) -> PairRows:
    """`batch` with the reference log-probabilities of its answers under `score`
    (`sequence_log_probs`), the model before training."""
    chosen, rejected = sequence_log_probs(score, batch, batch_size)
    arrays = {field.name: getattr(batch, field.name) for field in fields(batch)}
    return PairRows(**{**arrays, "reference_chosen": chosen, "reference_rejected": rejected})


def evaluate_pairs(score, batch: PairRows, objective: Objective, batch_size: int) -> dict[str, float]:
    """The held-out loss and TRL's metrics over every pair of `batch`, from forward passes."""
    terms, nll_sum, nll_tokens = [], 0.0, 0
    for start in range(0, batch.pairs, batch_size):
        rows = batch.take(slice(start, start + batch_size))
        inputs, targets, answers = sequence_rows(rows, objective)
        log_probs = score(inputs, targets)
        sums, counts, half = answer_sums(log_probs, answers), answers.sum(axis=1), rows.pairs
        terms.append(pair_terms(objective, sums[:half], sums[half:], counts[:half], counts[half:],
                                rows.reference_chosen, rows.reference_rejected))
        if objective.method == "orpo":
            read = targets[:half] != IGNORED_TARGET
            nll_sum -= float(np.where(read, log_probs[:half], 0.0).sum())
            nll_tokens += int(read.sum())
    loss = float(np.concatenate([term.losses for term in terms]).mean())
    if objective.method == "orpo":
        loss += nll_sum / nll_tokens
    return {"loss": loss, **pair_metrics(terms)}


def describe_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name} {metrics[name]:.4f}" for name in PAIR_METRICS if name in metrics)
