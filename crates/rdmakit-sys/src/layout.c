/*
 * C-side sizes and offsets of the libibverbs/librdmacm structs whose
 * layout matters most to the verbs provider (the ones with anonymous
 * unions: ibv_wc, ibv_send_wr, ibv_gid, ...; the QP attributes; the CM
 * event), as the C compiler lays them out.
 *
 * Compiled by build.rs into the crate's static archive; the unit tests in
 * src/lib.rs compare this table with `size_of`/`offset_of!` on the Rust
 * types bindgen generated with libclang, so a drift between the two fails
 * `cargo test`. Nothing outside the tests references it, so the linker
 * leaves it out of normal builds.
 *
 * Keep the order in sync with `C_LAYOUT_NAMES` in src/lib.rs.
 */
#include <stddef.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

const size_t rdmakit_sys_c_layout[] = {
	sizeof(union ibv_gid),
	sizeof(struct ibv_sge),
	sizeof(struct ibv_wc),
	offsetof(struct ibv_wc, status),
	offsetof(struct ibv_wc, opcode),
	offsetof(struct ibv_wc, byte_len),
	offsetof(struct ibv_wc, imm_data),
	offsetof(struct ibv_wc, qp_num),
	offsetof(struct ibv_wc, src_qp),
	offsetof(struct ibv_wc, wc_flags),
	offsetof(struct ibv_wc, pkey_index),
	offsetof(struct ibv_wc, slid),
	offsetof(struct ibv_wc, sl),
	offsetof(struct ibv_wc, dlid_path_bits),
	sizeof(struct ibv_send_wr),
	offsetof(struct ibv_send_wr, sg_list),
	offsetof(struct ibv_send_wr, num_sge),
	offsetof(struct ibv_send_wr, opcode),
	offsetof(struct ibv_send_wr, send_flags),
	offsetof(struct ibv_send_wr, imm_data),
	offsetof(struct ibv_send_wr, wr),
	offsetof(struct ibv_send_wr, wr.rdma.rkey),
	offsetof(struct ibv_send_wr, wr.atomic.compare_add),
	offsetof(struct ibv_send_wr, wr.atomic.swap),
	offsetof(struct ibv_send_wr, wr.atomic.rkey),
	offsetof(struct ibv_send_wr, wr.ud.remote_qpn),
	offsetof(struct ibv_send_wr, wr.ud.remote_qkey),
	offsetof(struct ibv_send_wr, qp_type),
	offsetof(struct ibv_send_wr, bind_mw),
	offsetof(struct ibv_send_wr, tso.mss),
	sizeof(struct ibv_recv_wr),
	sizeof(struct ibv_global_route),
	sizeof(struct ibv_ah_attr),
	offsetof(struct ibv_ah_attr, dlid),
	offsetof(struct ibv_ah_attr, port_num),
	sizeof(struct ibv_qp_attr),
	offsetof(struct ibv_qp_attr, ah_attr),
	offsetof(struct ibv_qp_attr, alt_ah_attr),
	offsetof(struct ibv_qp_attr, pkey_index),
	offsetof(struct ibv_qp_attr, rate_limit),
	sizeof(struct ibv_async_event),
	offsetof(struct ibv_async_event, event_type),
	sizeof(struct ibv_mw_bind_info),
	sizeof(struct rdma_cm_event),
	offsetof(struct rdma_cm_event, param),
	sizeof(struct rdma_addr),
	offsetof(struct rdma_addr, addr),
};

const size_t rdmakit_sys_c_layout_len =
	sizeof(rdmakit_sys_c_layout) / sizeof(rdmakit_sys_c_layout[0]);
