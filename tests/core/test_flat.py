"""core.flat: the flat buffer's parameter order and the weight-decay groups agree."""
import torch

from core.flat import FlatParameters, decays, flat_order, param_groups


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))


def test_flat_order_puts_the_decayed_matrices_first_each_group_in_model_order():
    model = _model()
    named = list(model.named_parameters())
    order = [n for n, _ in flat_order(named, param=lambda item: item[1])]
    assert order == ["0.weight", "2.weight", "0.bias", "1.weight", "1.bias"]
    assert [id(p) for p in flat_order(list(model.parameters()))] == [id(p) for n, p in flat_order(
        named, param=lambda item: item[1])]


def test_the_decayed_prefix_of_the_flat_buffer_is_the_decay_group():
    model = _model()
    params = list(model.parameters())
    flat = FlatParameters(flat_order(params))
    decay_group, rest = param_groups(params, 0.1)
    prefix = sum(p.numel() for p in decay_group["params"])
    assert all(decays(p) for p in decay_group["params"]) and not any(decays(p) for p in rest["params"])
    assert flat.offsets[len(decay_group["params"])] == prefix
    assert decay_group["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0


def test_ranges_are_the_slices_of_the_flat_buffer_that_hold_the_named_parameters():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 4), torch.nn.Embedding(2, 3))
    flat = FlatParameters(flat_order(list(model.parameters())))
    tables = {id(model[0].weight), id(model[2].weight)}
    ranges = flat.ranges(tables)
    assert [end - start for start, end in ranges] == [15, 6]
    for (start, end), table in zip(ranges, (model[0].weight, model[2].weight)):
        assert torch.equal(flat.data[start:end], table.detach().reshape(-1))
    assert flat.ranges(set()) == []
