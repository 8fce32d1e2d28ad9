"""The models of the federated benchmarks' papers: LEAF's FEMNIST CNN and the character LSTM of
McMahan et al. 2017 and LEAF, their sizes, their training through fedsim's flat SGD step, and the
vmap backend's refusal of recurrent layers."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fedsim
from fedsim.algorithms.local import LocalTrainer
from fedsim.core.errors import ConfigError
from fedsim.core.flat import FlatModel
from fedsim.data import Dataset
from fedsim.experiment import components
from fedsim.experiment.config import LocalConfig
from fedsim.experiment.federation import initial_model
from fedsim.models.zoo import MODELS, build_model


def count(model):
    return sum(p.numel() for p in model.parameters())


def test_femnist_cnn_is_leafs_cnn_layer_for_layer():
    """LEAF models/femnist/cnn.py: conv 32 5x5 "same", pool 2, conv 64 5x5 "same", pool 2, dense 2048, dense 62."""
    torch.manual_seed(0)
    model = build_model("femnist_cnn", (1, 28, 28), 62)
    conv1, conv2, dense = 5 * 5 * 1 * 32 + 32, 5 * 5 * 32 * 64 + 64, 7 * 7 * 64 * 2048 + 2048
    expected = conv1 + conv2 + dense + 2048 * 62 + 62
    assert count(model) == expected == 6_603_710
    assert "6,603,710" in dict(MODELS.describe())["femnist_cnn"]

    # the same function written with TensorFlow's "same" padding and its flatten after two poolings
    x = torch.randn(3, 1, 28, 28)
    h = F.max_pool2d(F.relu(F.conv2d(x, model.conv1.weight, model.conv1.bias, padding="same")), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, model.conv2.weight, model.conv2.bias, padding="same")), 2)
    assert h.shape == (3, 64, 7, 7)
    h = F.relu(h.flatten(1) @ model.fc1.weight.T + model.fc1.bias)
    expected_scores = h @ model.fc2.weight.T + model.fc2.bias
    scores = model(x)
    assert scores.shape == (3, 62)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-6)

    # tf.layers' defaults: Glorot-uniform kernels (bound sqrt(6 / (fan_in + fan_out))), zero biases
    for layer, fans in ((model.conv1, 25 * 1 + 25 * 32), (model.conv2, 25 * 32 + 25 * 64), (model.fc2, 2048 + 62)):
        bound = math.sqrt(6 / fans)
        assert layer.weight.abs().max() <= bound and layer.weight.abs().max() > 0.9 * bound
        assert not layer.bias.any()


def lstm_reference(model, ids):
    """The model's function written out: embedding, two LSTM layers (gates input, forget, cell,
    output; c' = f c + i g, h' = o tanh(c')), dense layer on the last step's output."""
    x = model.embed.weight[ids]
    for layer in range(2):
        w_ih, w_hh = getattr(model.lstm, f"weight_ih_l{layer}"), getattr(model.lstm, f"weight_hh_l{layer}")
        bias = getattr(model.lstm, f"bias_ih_l{layer}") + getattr(model.lstm, f"bias_hh_l{layer}")
        h = c = torch.zeros(len(ids), 256)
        outputs = []
        for t in range(ids.shape[1]):
            i, f, g, o = (x[:, t] @ w_ih.T + h @ w_hh.T + bias).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        x = torch.stack(outputs, dim=1)
    return x[:, -1] @ model.fc.weight.T + model.fc.bias


def test_char_lstm_is_leafs_stacked_lstm():
    """LEAF models/shakespeare/stacked_lstm.py with models/baseline_constants.py's sizes: 80
    characters embedded in 8 dimensions, two LSTM layers of 256, a dense layer over the 80."""
    torch.manual_seed(0)
    model = build_model("char_lstm", (80,), 80)
    embedding, dense = 80 * 8, 256 * 80 + 80

    def lstm_layer(inputs):  # four gates, input and recurrent weights, PyTorch's two bias vectors
        return 4 * 256 * (inputs + 256) + 2 * 4 * 256

    assert count(model) == embedding + lstm_layer(8) + lstm_layer(256) + dense == 819_920
    assert "819,920" in dict(MODELS.describe())["char_lstm"]
    # LEAF's TensorFlow cell keeps one bias vector a layer: 2 x 1,024 fewer
    assert count(model) - 2 * 4 * 256 == 817_872

    ids = torch.randint(0, 80, (3, 80), generator=torch.Generator().manual_seed(1))
    scores = model(ids)
    assert scores.shape == (3, 80) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, lstm_reference(model, ids), rtol=1e-4, atol=1e-5)

    # BasicLSTMCell's forget bias of 1, the other gates' biases 0
    for layer in range(2):
        bias = getattr(model.lstm, f"bias_ih_l{layer}") + getattr(model.lstm, f"bias_hh_l{layer}")
        assert bias[256:512].eq(1).all() and not bias[:256].any() and not bias[512:].any()
        kernel_bound = math.sqrt(6 / ((8 if layer == 0 else 256) + 256 + 4 * 256))
        assert getattr(model.lstm, f"weight_hh_l{layer}").abs().max() <= kernel_bound

    with pytest.raises(ConfigError, match=r"model: char_lstm failed when it was built .*shape \(steps,\)"):
        components.build_model("char_lstm", (1, 28, 28), 10)


def cycling_text(n, steps, seed):
    """``n`` windows of a text that repeats five distinct characters (of 80), each window
    ``steps`` characters long, labelled with the character that follows it."""
    generator = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(80, generator=generator)[:5]
    starts = torch.randint(0, 5, (n,), generator=generator)
    text = cycle[(starts[:, None] + torch.arange(steps + 1)) % 5]
    return text[:, :steps].contiguous(), text[:, steps].contiguous()


def test_char_lstm_step_through_the_flat_model_is_a_plain_sgd_step():
    """FlatModel re-points every parameter at a slice of one flat buffer; nn.LSTM computes from
    its ``_flat_weights`` list, which holds the same Parameter objects, so it must read (and its
    gradients land in) that buffer: one LocalTrainer step equals torch.optim.SGD's on a copy."""
    torch.manual_seed(0)
    module = build_model("char_lstm", (80,), 80)
    reference = copy.deepcopy(module)
    start = torch.cat([p.detach().flatten() for p in module.parameters()])
    model = FlatModel(module, "cpu")
    storage = model.flat.untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == storage for w in module.lstm._flat_weights)

    x, y = cycling_text(16, 80, seed=1)
    lr, seed = 0.5, 5
    trainer = LocalTrainer(model, x, y, LocalConfig(epochs=1, batch_size=16, lr=lr), num_classes=80)
    trained = trainer.train(torch.arange(16), model.flat.clone(), seed)
    assert trained.steps.item() == 1

    torch.manual_seed(seed)  # the order LocalTrainer draws for its one batch
    order = torch.randperm(16)
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    loss = F.cross_entropy(reference(x[order]), y[order])
    loss.backward()
    optimizer.step()
    expected = torch.cat([p.detach().flatten() for p in reference.parameters()])

    # every tensor moved, the LSTM's included: the gradients reached the flat buffer
    offset = 0
    for name, p in reference.named_parameters():
        assert not torch.equal(expected[offset : offset + p.numel()], start[offset : offset + p.numel()]), name
        offset += p.numel()
    # Same float32 operations on the same batch in the same order, and the same update
    # w - lr * g: only a kernel summing in another order on differently placed memory could tell
    # them apart, by a few roundings of the gradient's sums (relative 1e-6 of the largest step)
    # on top of the weights' own rounding (one float32 ulp, relative 2^-23).
    step = (expected - start).abs().max().item()
    torch.testing.assert_close(model.params, expected, rtol=2**-23, atol=1e-6 * step)
    assert trained.loss.item() == pytest.approx(loss.item(), rel=1e-6)


def test_char_lstm_learns_a_character_task_through_the_local_trainer():
    torch.manual_seed(0)
    model = FlatModel(build_model("char_lstm", (80,), 80), "cpu")
    x, y = cycling_text(64, 80, seed=1)
    with torch.no_grad():
        before = F.cross_entropy(model.module(x), y).item()
    assert before == pytest.approx(math.log(80), abs=0.05)  # near uniform over the 80 characters
    trainer = LocalTrainer(model, x, y, LocalConfig(epochs=2, batch_size=16, lr=0.1), num_classes=80)
    trained = trainer.train(torch.arange(64), None, seed=0)
    assert trained.steps.item() == 8
    with torch.no_grad():
        after = F.cross_entropy(model.module(x), y).item()
    # measured 4.37 -> 2.21: most of the way to ln 5 = 1.61, the loss of knowing which five characters occur
    assert after < before - 1.5


def quadrant_images(n, seed):
    """[n, 1, 28, 28] noise with a bright 8x8 square in one of four quadrants, the label."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=generator)
    x = 0.3 * torch.randn(n, 1, 28, 28, generator=generator)
    for i, quadrant in enumerate(y.tolist()):
        row, col = divmod(quadrant, 2)
        x[i, 0, row * 14 + 3 : row * 14 + 11, col * 14 + 3 : col * 14 + 11] += 1.0
    return x, y


def test_femnist_cnn_learns_a_simple_task_in_a_few_steps():
    torch.manual_seed(0)
    model = FlatModel(build_model("femnist_cnn", (1, 28, 28), 62), "cpu")
    x, y = quadrant_images(64, seed=0)
    test_x, test_y = quadrant_images(64, seed=1)
    with torch.no_grad():
        before = F.cross_entropy(model.module(test_x), test_y).item()
    trainer = LocalTrainer(model, x, y, LocalConfig(epochs=2, batch_size=16, lr=0.05), num_classes=62)
    assert trainer.train(torch.arange(64), None, seed=0).steps.item() == 8
    with torch.no_grad():
        scores = model.module(test_x)
    # measured on these held-out samples: 4.16 (near ln 62) -> 0.02, every one right
    assert before > 3.5 and F.cross_entropy(scores, test_y).item() < 0.5
    assert (scores.argmax(1) == test_y).float().mean().item() >= 0.9


def character_data():
    x, y = cycling_text(8, 80, seed=2)
    return Dataset(x, y, x.clone(), y.clone(), num_classes=80, name="characters")


def test_vmap_backend_refuses_a_recurrent_model_in_one_line(tmp_path):
    data = character_data()
    cfg = fedsim.load_config({"model": "char_lstm", "backend": "vmap", "device": "cpu"})
    with pytest.raises(ConfigError) as refused:
        initial_model(cfg, data)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("backend: vmap cannot train char_lstm")
    assert "(LSTM)" in message and message.endswith("use backend: process")

    process = fedsim.load_config({"model": "char_lstm", "backend": "process", "device": "cpu"})
    assert count(initial_model(process, data)) == 819_920
    cnn_cfg = fedsim.load_config({"model": "femnist_cnn", "backend": "vmap", "device": "cpu"})
    images = Dataset(*quadrant_images(4, 0), *quadrant_images(4, 1), num_classes=62)
    assert count(initial_model(cnn_cfg, images)) == 6_603_710  # vmap trains the CNN

    # a run refuses it before anything is written
    run = {"model": "char_lstm", "backend": "vmap", "device": "cpu", "workers": 0, "clients_per_round": 2}
    with pytest.raises(ConfigError, match=r"^config: backend: vmap cannot train char_lstm, [^\n]*backend: process$"):
        fedsim.run({**run, "data": {"dataset": data, "num_clients": 4}}, out=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()
