"""ResNet-18, CIFAR variant (He et al. 2016, "Deep Residual Learning", arXiv:1512.03385).

The CIFAR variant replaces ImageNet's 7x7 stride-2 stem and max-pool with one 3x3
stride-1 conv, as in the paper's CIFAR experiments, so 32x32 inputs keep their
resolution into the first stage. About 11.2M parameters (45 MB in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from fedq.models.registry import MODELS


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18Cifar(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> None:
        super().__init__()
        channels = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        stages = []
        c_in = width
        for i, c_out in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if i == 0 else 2
            stages += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, 8w, H/8, W/8)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)  # (B, 8w)
        return self.head(x)


@MODELS.register("resnet18_cifar")
def resnet18_cifar(input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> nn.Module:
    return ResNet18Cifar(input_shape, num_classes, width=width)
