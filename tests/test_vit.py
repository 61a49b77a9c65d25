import jax
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

from decoupled_diloco import config as config_lib
from decoupled_diloco.data import vision as vision_data
from decoupled_diloco.models import vit
from decoupled_diloco.models.mesh import make_island_mesh
from decoupled_diloco.train import train_and_evaluate


def vit_config(**overrides):
    base = {
        "model.kind": "vit",
        "model.d_model": 32,
        "model.num_heads": 4,
        "model.mlp_hidden": 64,
        "model.patch_size": 2,
        "data.dataset": "digits",
        "data.batch_size": 16,
        "data.val_fraction": 0.2,
        "eval.batches": 4,
    }
    return tiny_config(**{**base, **overrides})


@pytest.fixture(scope="module")
def digits():
    return vision_data.load_images("digits", val_fraction=0.2)


def test_patches_and_position_embeddings_have_the_declared_shapes():
    image = np.arange(8 * 8, dtype=np.float32).reshape(1, 8, 8, 1)
    patches = np.asarray(vit.patchify(image, 2))
    assert patches.shape == (1, 16, 4)
    # Row-major patch grid; each patch's pixels row-major.
    np.testing.assert_array_equal(patches[0, 0], [0, 1, 8, 9])
    np.testing.assert_array_equal(patches[0, 1], [2, 3, 10, 11])
    np.testing.assert_array_equal(patches[0, 4], [16, 17, 24, 25])
    config = vit_config()
    mnist_config = config_lib.replace(config, **{"model.patch_size": 4})
    with jax.set_mesh(make_island_mesh((1, 1), jax.devices()[:1])):  # shapes only: no compute
        model = nnx.eval_shape(lambda: vit.ViT(config.model, (8, 8, 1), 10, nnx.Rngs(0)))
        mnist = nnx.eval_shape(lambda: vit.ViT(mnist_config.model, (28, 28, 1), 10, nnx.Rngs(0)))
        images = jax.ShapeDtypeStruct((3, 8, 8, 1), np.float32)
        embedded = nnx.eval_shape(lambda m, x: m.embed(x), model, images)
        logits = nnx.eval_shape(lambda m, x: m(x), model, images)
    assert model.num_patches == 16 and model.pos_embed.shape == (16, 32)
    assert model.patch_embed.kernel.shape == (4, 32)
    assert embedded.shape == (3, 16, 32) and logits.shape == (3, 10)
    assert mnist.num_patches == 49 and mnist.pos_embed.shape == (49, 32)
    assert mnist.patch_embed.kernel.shape == (16, 32)


def test_config_checks_patches_and_dataset():
    with pytest.raises(config_lib.ConfigError, match="model.patch_size"):
        vit_config(**{"model.patch_size": 3})
    with pytest.raises(config_lib.ConfigError, match="data.dataset"):
        vit_config(**{"data.dataset": "text"})
    with pytest.raises(config_lib.ConfigError, match="data.dataset"):
        tiny_config(**{"data.dataset": "digits"})  # a text model on images


def test_digits_split_shards_and_resumable_augmented_iterators(digits):
    assert digits.image_shape == (8, 8, 1)
    assert len(digits.train.labels) + len(digits.val.labels) == 1797
    assert abs(float(digits.train.images.mean())) < 1e-4  # standardized on the train split
    again = vision_data.load_images("digits", val_fraction=0.2)
    np.testing.assert_array_equal(digits.val.labels, again.val.labels)
    # One epoch of each of 3 learners' shards: disjoint, together the whole train split.
    epochs = []
    for learner in range(3):
        it = vision_data.train_iterator(digits, 1, learner, 3, seed=5)
        size = len(range(learner, len(digits.train.labels), 3))
        epochs += [next(it)["image"].tobytes() for _ in range(size)]
    assert sorted(epochs) == sorted(x.tobytes() for x in digits.train.images)
    it = vision_data.train_iterator(digits, 8, 1, 3, seed=5, augment=True)
    for _ in range(70):  # past the end of the 160-image shard: a reshuffled second epoch
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = vision_data.train_iterator(digits, 8, 1, 3, seed=5, augment=True)
    resumed.set_state(state)
    for batch, want in zip([next(resumed) for _ in range(3)], expected, strict=True):
        assert batch["image"].shape == (8, 8, 8, 1) and batch["label"].dtype == np.int32
        np.testing.assert_array_equal(batch["image"], want["image"])
        np.testing.assert_array_equal(batch["label"], want["label"])
    # An augmented image is the plain one shifted by at most one pixel, background filled.
    plain = vision_data.learner_dataset(digits, 1, 0, 1, seed=0)[0]["image"][0]
    shifted = vision_data.learner_dataset(digits, 1, 0, 1, seed=0, augment=True)[0]["image"][0]
    padded = np.pad(plain, ((1, 1), (1, 1), (0, 0)), constant_values=digits.background)
    windows = [padded[dy : dy + 8, dx : dx + 8] for dy in range(3) for dx in range(3)]
    assert any(np.array_equal(shifted, w) for w in windows)
    with pytest.raises(ValueError, match="eval.batches"):
        vision_data.validation_batches(digits, 32, 100)
    with pytest.raises(ValueError, match="data.batch_size"):
        vision_data.train_iterator(digits, 1000, 0, 2, seed=0)


def test_vit_learns_digits_above_chance_in_a_handful_of_steps(digits, tmp_path):
    config = vit_config(mode="dp", train_steps=25, **{"optim.lr": 3e-3, "optim.warmup_steps": 3})
    result = train_and_evaluate(config, tmp_path, corpus=digits)
    s = result.summary
    assert s["dataset"]["name"] == "digits" and s["tokens"] == 25 * 2 * 16
    assert s["final_eval_accuracy"] > 0.3  # chance: 0.1
    assert s["final_eval_loss"] < np.log(10)
    lines = (tmp_path / "metrics.jsonl").read_text()
    assert '"eval_accuracy"' in lines
