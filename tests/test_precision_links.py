"""Links between neighbouring LP layers at the same bf16/fp16 precision: which layers link (from
the layer table), what a linked model runs (the low-precision tensor passed on, fewer casts, the
same numbers across ReLU), and the pass-through probes."""

import pytest
import torch
from torch import nn

from qsync_callback.lp import restore
from qsync_callback.lp.costs import probe_pass_through_costs
from qsync_callback.lp.swap import apply_precision_plan, link_neighbours
from qsync_callback.model_layers import sequential_next
from qsync_callback.precision_links import Link, pass_through_candidates, precision_links


def _table(*rows):
    """Layer-table rows (name, type, next) for a chain written in order."""
    return [{"name": n, "type": t, "next": following} for n, t, following in rows]


CHAIN = _table(
    ("0", "Linear", "1"),
    ("1", "ReLU", "2"),
    ("2", "Dropout", "3"),
    ("3", "Linear", "4"),
    ("4", "LayerNorm", "5"),
    ("5", "Linear", "6"),
    ("6", "GELU", "7"),
    ("7", "Linear", None),
)


def test_links_join_equal_float_neighbours_across_pass_through_layers_only():
    plan = {"0": "bf16", "3": "bf16", "5": "bf16", "7": "bf16"}
    # 3 -> LayerNorm -> 5 is not a link: a LayerNorm is not a pass-through layer
    assert precision_links(CHAIN, plan) == [
        Link("0", ("1", "2"), "3", "bf16"),
        Link("5", ("6",), "7", "bf16"),
    ]
    # different precisions, int8 (no float tensor to pass), fp32 and tf32 do not link
    assert precision_links(CHAIN, {"0": "bf16", "3": "fp16"}) == []
    assert precision_links(CHAIN, {"0": "int8", "3": "int8"}) == []
    assert precision_links(CHAIN, {"5": "fp32", "7": "fp32"}) == []
    assert precision_links(CHAIN, {"5": "fp16", "7": "fp16"}) == [Link("5", ("6",), "7", "fp16")]
    # a table without "next" (a trace recorded before it was kept) links nothing
    assert precision_links([{"name": r["name"], "type": r["type"]} for r in CHAIN], plan) == []


def test_pass_through_candidates_lie_between_two_lp_layers():
    assert pass_through_candidates(CHAIN, ["0", "3", "5", "7"]) == ["1", "2", "6"]
    assert pass_through_candidates(CHAIN, ["0", "5", "7"]) == ["6"]  # 3 is not an LP layer here


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.0), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)  # not in the Sequential: never linked

    def forward(self, x):
        return self.head(self.body(x))


def test_sequential_next_follows_sequential_children_only():
    assert sequential_next(_Net()) == {
        "body.0": "body.1",
        "body.1": "body.2",
        "body.2": "body.3",
        "body.3": None,
        "head": None,
    }


def test_sequential_next_leaves_out_what_may_not_feed_the_next_child():
    class Residual(nn.Sequential):  # its own forward: the children's outputs go elsewhere too
        def forward(self, x):
            return x + super().forward(x)

    shared = nn.Linear(8, 8)
    model = nn.Sequential(
        Residual(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), shared, nn.ReLU(), nn.Linear(8, 8)
    )
    model.again = shared  # registered twice: its output may go to a stock layer
    following = sequential_next(model)
    assert following["0.0"] is None and following["0.1"] is None
    assert following["1"] is None  # the shared Linear
    assert following["2"] == "3"
    lp = apply_precision_plan(model, {"0.0": "bf16", "0.2": "bf16", "1": "bf16", "3": "bf16"})
    assert all(m.output_dtype is None for m in lp.values())  # nothing linked
    model(torch.randn(2, 8)).sum().backward()


def _run(model, x):
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_linked_model_passes_bf16_through_relu_with_the_same_numbers():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 16)
    plan = {"body.0": "bf16", "body.3": "bf16", "head": "bf16"}
    lp = apply_precision_plan(model, plan)
    seen = []
    model.body[1].register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    linked_out, linked_grads = _run(model, x)
    assert seen == [torch.bfloat16]
    assert lp["body.0"].output_dtype == torch.bfloat16
    assert lp["body.3"].output_dtype == torch.float32  # takes bf16, gives the head fp32
    assert lp["head"].output_dtype is None
    assert linked_out.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in linked_grads)
    with torch.profiler.profile() as prof:
        model(x).sum().backward()
    linked_casts = sum(1 for e in prof.events() if e.name.startswith("qsync::cast_"))

    for module in lp.values():  # unlink: every layer casts its output back
        module.precision = module.precision
    seen.clear()
    unlinked_out, unlinked_grads = _run(model, x)
    assert seen == [torch.float32]
    with torch.profiler.profile() as prof:
        model(x).sum().backward()
    unlinked_casts = sum(1 for e in prof.events() if e.name.startswith("qsync::cast_"))
    assert linked_casts == unlinked_casts - 1  # body.0's output cast back is gone
    # ReLU and a zero dropout commute with rounding to bf16: linking changes no number
    assert torch.equal(linked_out, unlinked_out)
    assert all(torch.equal(a, b) for a, b in zip(linked_grads, unlinked_grads, strict=True))

    assert link_neighbours(model, lp) == [Link("body.0", ("body.1", "body.2"), "body.3", "bf16")]
    restore(model, lp)
    assert all(type(m) in (nn.Linear, nn.ReLU, nn.Dropout, nn.Sequential, _Net) for m in model.modules())


@pytest.mark.parametrize("module", [nn.ReLU(), nn.Dropout(0.5), nn.MaxPool2d(2), nn.Flatten()])
def test_pass_through_probe_measures_each_precision_and_leaves_the_rng_alone(module):
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    costs = probe_pass_through_costs(module, [4, 3, 8, 8], "cpu", ["fp32", "bf16", "int8"], repeats=2)
    assert torch.equal(torch.rand(3), expected)
    assert list(costs) == ["fp32", "bf16"]  # int8 has no float tensor to pass through
    for probe in costs.values():
        assert probe["forward_us"] > 0 and probe["backward_us"] > 0
    if isinstance(module, nn.ReLU):  # saves its output: half the bytes at bf16
        assert costs["fp32"]["saved_bytes"] == 4 * 3 * 8 * 8 * 4
        assert costs["bf16"]["saved_bytes"] == costs["fp32"]["saved_bytes"] / 2
    if isinstance(module, nn.Flatten):  # a view: saves nothing
        assert costs["fp32"]["saved_bytes"] == costs["bf16"]["saved_bytes"] == 0
