"""cluster.train.dispatch_layers moves each decoder layer straight to its device: a model built
layer by layer on its devices (a 32B-class lazy student over 2 or 4 GPUs, none of which holds
the whole) is never gathered on the first device. The meta device stands in for a second GPU:
copying a meta tensor to the CPU raises, so a layer routed through devices[0] would fail."""

from __future__ import annotations

import torch
from torch import nn

from cluster.train import dispatch_layers


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(8, 4)
        self.model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.head = nn.Linear(4, 8)


def test_layers_go_straight_to_their_device():
    m = _Tiny()
    for layer in m.model.layers[2:]:  # already on their (second) device, as built there
        layer.to("meta")
    placement = dispatch_layers(m, ["cpu", "meta"])
    assert placement == {0: "cpu", 1: "cpu", 2: "meta", 3: "meta"}
    assert all(p.device.type == "meta" for layer in m.model.layers[2:] for p in layer.parameters())
    assert m.model.layers[0].weight.device.type == "cpu"
    assert m.model.embed.weight.device.type == "cpu" and m.head.weight.device.type == "cpu"
    assert len(m.model.layers) == 4 and [n for n, _ in m.model.layers.named_children()] == \
        ["0", "1", "2", "3"]


def test_the_rest_goes_to_the_first_device_and_the_forward_runs():
    m = _Tiny()
    dispatch_layers(m, ["cpu", "cpu"])
    x = m.model.embed(torch.tensor([[1, 2]]))
    for layer in m.model.layers:
        x = layer(x)
    assert m.head(x).shape == (1, 2, 8)
