"""Float32 AdamW training of a real model, ours against PyTorch's, as test_smollm2_training.py and
test_gemma3_training.py compare them: the same weights, the same batches, the same settings.

The rate is 30x a fine-tune's: one step moves the loss a long way, so an update that differs from
torch's shows in the next loss."""

import numpy as np
import torch
from tests.support.model_folders import transformers_folder

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1


def torch_losses(model_class, folder, batches) -> list[float]:
    """transformers' `model_class` from `folder` (SDPA attention) with torch.optim.AdamW."""
    model = model_class.from_pretrained(transformers_folder(folder), dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    return torch_steps(model, optimizer, batches)


def torch_steps(model, optimizer, batches) -> list[float]:
    """The losses of a torch training step (next-token cross-entropy, `optimizer`) per batch."""
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        logits = model(torch.from_numpy(inputs)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(targets).reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def our_losses(package, folder, batches) -> list[float]:
    """The generated `package` from `folder` with its AdamW."""
    model = package.Model.from_safetensors(folder)
    optimizer = package.AdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return [package.train_step(model, optimizer, inputs, targets) for inputs, targets in batches]


def relative_differences(ours: list[float], theirs: list[float]) -> np.ndarray:
    return np.abs(np.array(ours) - np.array(theirs)) / np.abs(np.array(theirs))


LORA_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
# a LoRA fine-tune's rate (pyml's and TRL's default with LoRA). At 10x that, Gemma's three losses
# differed by 8e-6, 2.4e-5 and 4.1e-5 relative: its first forward already differs by 8e-6 in float32
# (SmolLM2's: under 1e-6), and a larger rate carries that through the update.
LORA_RANK, LORA_ALPHA, LORA_LR = 8, 16.0, 2e-4


def lora_losses(model_class, folder, batches) -> tuple[list[float], list[float]]:
    """(ours, peft's) losses of LoRA training over the base of `folder`: ours over the base as the
    folder stores it (its linear maps read from the GGUF: QLoRA), peft's on transformers'
    `model_class` of the dequantized float32 base; the same adapters to start (ours, A random
    and B zero, copied into peft's), torch.optim.AdamW against ours."""
    import gc

    from peft import LoraConfig, get_peft_model

    from pyml.packages import spec_file
    from pyml.train.lora import PEFT_MODULES, lora_settings, lora_spec

    _, package = lora_spec(spec_file(folder), lora_settings(LORA_RANK, LORA_ALPHA, LORA_TARGETS))
    model = package.Model.from_base(folder, seed=0)
    assert model.stored_maps is not None  # the base's matrices stay in the GGUF
    adapters = model.adapter_tensors()
    optimizer = package.AdamW(model, lr=LORA_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    ours = [package.train_step(model, optimizer, inputs, targets) for inputs, targets in batches]
    del model, optimizer
    gc.collect()
    reference = model_class.from_pretrained(transformers_folder(folder), dtype=torch.float32)
    reference.config._attn_implementation = "sdpa"
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none",
                        target_modules=[PEFT_MODULES[t] for t in LORA_TARGETS])
    reference = get_peft_model(reference, config)
    trainable = {name.removeprefix("base_model.model.").replace(".default", ""): param
                 for name, param in reference.named_parameters() if param.requires_grad}
    assert set(trainable) == set(adapters)
    with torch.no_grad():
        for name, param in trainable.items():
            param.copy_(torch.from_numpy(adapters[name]))
    torch_optimizer = torch.optim.AdamW(list(trainable.values()), lr=LORA_LR, betas=BETAS, eps=EPS,
                                        weight_decay=WEIGHT_DECAY)
    return ours, torch_steps(reference, torch_optimizer, batches)
