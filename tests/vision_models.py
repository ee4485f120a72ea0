"""Small vision and recurrent models built by hand for the tests and the benchmark: a ResNet in
torchvision's layout (7x7 stem, BatchNorm, max pool, BasicBlocks with a strided 1x1 shortcut,
adaptive average pool, fc), a U-Net block (down by max pool, up by transposed conv, skip
concatenation, GroupNorm) and a GRU/LSTM sequence classifier."""
from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision.models.resnet's layout, narrow: widths (w, 2w), one block per stage."""

    def __init__(self, width: int = 8, classes: int = 10, blocks: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(*[BasicBlock(width, width) for _ in range(blocks)])
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), *[BasicBlock(2 * width, 2 * width)
                                                                       for _ in range(blocks - 1)])
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class UNetBlock(nn.Module):
    """One level of a U-Net: encode, go down, come back up, join the skip, decode."""

    def __init__(self, cin: int = 3, width: int = 8, cout: int = 2):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(cin, width, 3, padding=1), nn.GroupNorm(2, width), nn.SiLU())
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.InstanceNorm2d(2 * width, affine=True),
                                 nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                 nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(width, cout, 1))

    def forward(self, x):
        skip = self.enc(x)
        y = self.up(self.mid(self.down(skip)))
        return self.dec(torch.cat([y, skip], dim=1))


class SequenceClassifier(nn.Module):
    """A recurrent encoder (GRU, LSTM or RNN, batch first) and a linear head on the last step."""

    def __init__(self, cell: str = "GRU", features: int = 5, hidden: int = 8, classes: int = 3):
        super().__init__()
        self.rnn = getattr(nn, cell)(features, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])
