#!/usr/bin/env bash
# Installs Fashion-MNIST's IDX files from Debian's `dataset-fashion-mnist` into /usr/share/datasets/fashion-mnist.
set -u
DIR=/usr/share/datasets/fashion-mnist
if [ -f "$DIR/train-images-idx3-ubyte.gz" ]; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) \
   && echo "installed Fashion-MNIST into $DIR" && exit 0
fi
echo "Fashion-MNIST not found in $DIR. Install it with 'sudo apt-get install dataset-fashion-mnist'," >&2
echo "or pass data.path=FOLDER (a folder with the FashionMNIST IDX files, e.g. a torchvision download) to the trainers." >&2
exit 0
