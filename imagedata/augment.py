"""``--augment``: random crops and horizontal flips of a whole batch, on the device.

Done per image on the CPU (a transform per sample in the data loader, as torchvision's are),
augmentation costs host cores per image that a GPU consuming thousands of images a second would
need by the dozen. Here it is one gather over the batch already on the device: each image is
shifted by up to 1/8 of its side in each direction (edges repeated, as padding does) and
mirrored with probability 1/2, all drawn at once from the device's random stream (which
checkpoints keep, so a resumed run draws what it would have).
"""

from __future__ import annotations

import torch

SHIFT_FRACTION = 8  # shifts of up to side / 8 pixels


def flip_crop(images: torch.Tensor) -> torch.Tensor:
    """``images`` (N, C, H, W), any dtype, each shifted and perhaps mirrored; same shape and
    device, in channels-last layout (what the convolutions read fastest on a GPU)."""
    n, _, height, width = images.shape
    device = images.device
    dy = torch.randint(
        -(height // SHIFT_FRACTION), height // SHIFT_FRACTION + 1, (n, 1), device=device
    )
    dx = torch.randint(
        -(width // SHIFT_FRACTION), width // SHIFT_FRACTION + 1, (n, 1), device=device
    )
    flip = torch.rand((n, 1), device=device) < 0.5
    ys = torch.arange(height, device=device)
    xs = torch.arange(width, device=device)
    rows = (ys + dy).clamp(0, height - 1)  # (N, H)
    cols = torch.where(flip, width - 1 - xs, xs)  # mirrored, then shifted
    cols = (cols + dx).clamp(0, width - 1)  # (N, W)
    batch = torch.arange(n, device=device)[:, None, None]
    # (N, H, W, C): indexing by (batch, rows, cols) moves the channel axis last
    gathered = images.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]
    return gathered.permute(0, 3, 1, 2)
