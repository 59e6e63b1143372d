#!/bin/sh
# Stand-in for nvidia-smi on a GPU-less machine: one GPU, held by "nv-hostengine" until the
# first query of its compute processes has been answered (a service that lets go of the GPU).
case "$*" in
  *query-compute-apps*)
    if [ ! -e "$FAKE_GPU_RELEASED" ]; then
      touch "$FAKE_GPU_RELEASED"
      echo "GPU-fake-0, 4242, nv-hostengine, 512"
    fi ;;
  *query-gpu*) echo "0, GPU-fake-0" ;;
esac
