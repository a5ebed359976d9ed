// The ENC_IDX16 block: a stream's words go in blocks of this many, and a changed word's index within its
// block is stored in 16 bits. One definition for the CUDA kernels (weightsync/delta/kernels.cu, compiled
// by NVRTC with this directory on its include path), the host kernels (cpp/delta/host_delta.cpp) and the
// Python codec (weightsync/delta/codec.py reads it from this file).
#pragma once

#define WS_DELTA_BLOCK_BITS 16
#define WS_DELTA_BLOCK_WORDS (1 << WS_DELTA_BLOCK_BITS)
