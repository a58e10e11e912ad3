"""Small models for small images (digits 8x8, MNIST 28x28, CIFAR 32x32)."""

from __future__ import annotations

import torch
from torch import nn

from fedq.models.registry import MODELS


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks and a linear head; about 20k parameters on 8x8 digits."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> None:
        super().__init__()
        channels, height, width_px = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),  # (B, w, H, W)
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),  # (B, 2w, H, W)
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 2w, H/2, W/2)
        )
        flat = 2 * width * (height // 2) * (width_px // 2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(flat, 64), nn.ReLU(),
                                  nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


class MLP(nn.Module):
    """A two-layer perceptron over flattened inputs."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        size = 1
        for dim in input_shape:
            size *= dim
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(size, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@MODELS.register("small_cnn")
def small_cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    return SmallCNN(input_shape, num_classes, width=width)


@MODELS.register("mlp")
def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> nn.Module:
    return MLP(input_shape, num_classes, hidden=hidden)
