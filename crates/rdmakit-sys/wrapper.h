/*
 * Input header for rdmakit-sys's bindgen runs (see build.rs): libibverbs, librdmacm and mlx5
 * direct verbs. The first run binds the `ibv_*`/`rdma_*` items, the second the `mlx5dv_*`
 * items over the first run's types.
 */
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <infiniband/mlx5dv.h>
