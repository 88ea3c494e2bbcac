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
