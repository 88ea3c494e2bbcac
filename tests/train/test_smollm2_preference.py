"""DPO on the shipped SmolLM2-135M-Instruct in float32, LoRA over the base as its GGUF stores it,
against TRL's DPOTrainer with peft on transformers' dequantized float32 model: the same pairs (the
shipped pydoc topics with a right and a wrong answer), the same adapters to start, three AdamW
steps' losses within 1e-5 relative. The first step's loss is log 2 exactly on both sides (the model
is its reference); the next two show that both took the same update. Measured (2026-12-06): 2.7e-9,
1.9e-6 and 6.3e-6 relative."""

import json

import numpy as np
import pytest
import torch

from pyml.packages import spec_file
from pyml.train.example_chats import pairs as example_pairs
from pyml.train.folder_data import FolderTokens
from pyml.train.lora import PEFT_MODULES, lora_settings, lora_spec
from pyml.train.preference import Objective, load_pairs, pair_rows, preference_loss_and_grads, with_reference
from tests.support.model_folders import transformers_folder
from tests.support.real_model_training import BETAS, EPS, LORA_ALPHA, LORA_LR, LORA_RANK, LORA_TARGETS, WEIGHT_DECAY

SEQ, PAIRS_PER_STEP, STEPS = 256, 2, 3


@pytest.mark.slow
def test_three_dpo_lora_steps_match_trl_in_float32(smollm2_folder, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    folder = smollm2_folder
    _, package = lora_spec(spec_file(folder), lora_settings(LORA_RANK, LORA_ALPHA, LORA_TARGETS))
    model = package.Model.from_base(folder, seed=0)
    tokens = FolderTokens(folder, package.Model.VOCAB, "smollm2_135m")
    # the first pairs whose sequences fit SEQ, one file line each
    lines = example_pairs()
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    pairs, _ = load_pairs(data, tokens)
    fitting = [pair for pair in pairs if max(len(pair.chosen), len(pair.rejected)) + len(pair.prompt) - 1 <= SEQ]
    fitting = fitting[: PAIRS_PER_STEP * STEPS]
    rows, _ = pair_rows(fitting, SEQ, tokens.pad_id)
    rows = with_reference(rows, model.target_log_probs, PAIRS_PER_STEP)
    chosen_lines = [lines[int(pair.where.rsplit(":", 1)[1]) - 1] for pair in fitting]
    adapters = model.adapter_tensors()
    optimizer = package.AdamW(model, lr=LORA_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    objective = Objective("dpo")
    ours = []
    for step in range(STEPS):
        ours.append(preference_loss_and_grads(model, rows.take(range(step * PAIRS_PER_STEP, (step + 1) * PAIRS_PER_STEP)),
                                              objective).loss)
        optimizer.step()

    policy = AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float32,
                                                  attn_implementation="sdpa")
    args = DPOConfig(output_dir=str(tmp_path / "trl"), learning_rate=LORA_LR, beta=0.1, bf16=False,
                     gradient_checkpointing=False, report_to=[], max_length=None, use_cpu=True,
                     per_device_train_batch_size=PAIRS_PER_STEP)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none",
                        target_modules=[PEFT_MODULES[t] for t in LORA_TARGETS])
    trainer = DPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(chosen_lines),
                         processing_class=AutoTokenizer.from_pretrained(transformers_folder(folder)),
                         peft_config=config)
    for pair, example in zip(fitting, trainer.train_dataset, strict=True):
        assert (pair.prompt, pair.chosen, pair.rejected) == (
            example["prompt_ids"], example["chosen_ids"], example["rejected_ids"])
    trainable = {name.removeprefix("base_model.model.").replace(".default", ""): param
                 for name, param in trainer.model.named_parameters() if param.requires_grad}
    assert set(trainable) == set(adapters)
    with torch.no_grad():
        for name, param in trainable.items():
            param.copy_(torch.from_numpy(adapters[name]))
    torch_optimizer = torch.optim.AdamW(list(trainable.values()), lr=LORA_LR, betas=BETAS, eps=EPS,
                                        weight_decay=WEIGHT_DECAY)
    trainer.model.train()
    theirs = []
    for step in range(STEPS):
        torch_optimizer.zero_grad()
        batch = trainer.data_collator([trainer.train_dataset[index]
                                       for index in range(step * PAIRS_PER_STEP, (step + 1) * PAIRS_PER_STEP)])
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        torch_optimizer.step()
        theirs.append(loss.item())
    relative = np.abs(np.array(ours) - np.array(theirs)) / np.array(theirs)
    assert ours[0] == pytest.approx(np.log(2), rel=1e-7)
    assert relative.max() <= 1e-5, list(zip(ours, theirs, strict=True))
