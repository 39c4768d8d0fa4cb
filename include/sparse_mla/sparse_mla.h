// Umbrella header of the sparse-mla C++ API.
#pragma once

#include "sparse_mla/backend.h"
#include "sparse_mla/kv_cache.h"
#include "sparse_mla/ops.h"
#include "sparse_mla/status.h"
#include "sparse_mla/tensor.h"
