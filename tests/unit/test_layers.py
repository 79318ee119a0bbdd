"""Which entries of a flat weight vector belong to which layer (rayfl.algorithms.layers), checked against the
vector rayfl.training.to_vector makes: a layer's range holds exactly that layer's weights and bias."""

import numpy as np
import pytest
import torch
from torch import nn

from rayfl import training
from rayfl.algorithms.layers import layer_slices, top_mask


def model():
    torch.manual_seed(0)
    # 3*4 + 4 = 16 entries for layer "1", 4*2 + 2 = 10 for layer "3"; Flatten and ReLU own none
    return nn.Sequential(nn.Flatten(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_layers_are_the_modules_owning_weights_in_vector_order():
    m = model()
    assert layer_slices(m) == [("1", slice(0, 16)), ("3", slice(16, 26))]
    vec = training.to_vector(m)
    s1, s3 = dict(layer_slices(m))["1"], dict(layer_slices(m))["3"]
    np.testing.assert_array_equal(vec[s1], np.concatenate([m[1].weight.detach().numpy().ravel(), m[1].bias.detach().numpy()]))
    np.testing.assert_array_equal(vec[s3], np.concatenate([m[3].weight.detach().numpy().ravel(), m[3].bias.detach().numpy()]))


def test_a_flattened_model_has_the_same_layers():
    assert layer_slices(training.flatten(model())) == layer_slices(model())


def test_a_layer_with_buffers_is_one_range_and_integer_buffers_take_no_room():
    m = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    # BatchNorm1d(3): weight 3, bias 3, running_mean 3, running_var 3 (floating); num_batches_tracked is an integer
    assert layer_slices(m) == [("0", slice(0, 9)), ("1", slice(9, 21)), ("2", slice(21, 25))]
    assert training.to_vector(m).size == 25


def test_top_mask_marks_the_top_k_layers():
    m = model()
    assert not top_mask(m, 0).any() and top_mask(m, 0).size == 26
    np.testing.assert_array_equal(np.flatnonzero(top_mask(m, 1)), np.arange(16, 26))
    assert top_mask(m, 2).all()
    with pytest.raises(ValueError, match="k=3: the model has 2 layers"):
        top_mask(m, 3)
    with pytest.raises(ValueError, match="k=-1"):
        top_mask(m, -1)
