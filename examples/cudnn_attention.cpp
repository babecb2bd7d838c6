// The one translation unit that compiles attention through cuDNN for the CUDA binaries
// (llama-train, the GPU tests): cudnn_attention_impl.hpp says why one. Host C++ (g++);
// with the frontend's headers found at configure time Meson adds their folder and
// -DTESSERA_WITH_CUDNN_FRONTEND=1, without them the entry points report that.
#include "tessera/backend/cuda/cudnn_attention_impl.hpp"
