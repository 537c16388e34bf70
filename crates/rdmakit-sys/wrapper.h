/*
 * Input header for rdmakit-sys's bindgen runs (see build.rs).
 *
 * libibverbs/librdmacm types and exported functions come from the
 * `rdma-sys` crate; bindgen only generates what rdma-sys lacks: the mlx5
 * direct-verbs API, the few static-inline verbs helpers rdma-sys does not
 * re-implement, and verbs.h macro / anonymous-enum constants.
 */
#include <infiniband/verbs.h>
#include <infiniband/mlx5dv.h>
