/* An attacker on a member's host (tests/security/test_engine_auth.py): it has stolen an engine's address
   (its listening socket) and a region's remote key, but not the engine key. It connects with a core tcp
   MSG endpoint carrying connection data of its own making, and, should it be let in, writes into the
   region with an immediate. Prints one line per step; exit status 0 whatever happened (the test judges).

   usage: fabric_attacker HOST PORT REMOTE_ADDR KEY IMM MODE      MODE: crafted | empty | junk | HEX
   HEX: the connection data given as 112 hex digits (a request made by the test itself). */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x)                                                                                \
  do {                                                                                          \
    int rc_ = (int)(x);                                                                         \
    if (rc_ < 0) {                                                                              \
      printf("error %s = %d (%s)\n", #x, rc_, fi_strerror(-rc_));                               \
      return 0;                                                                                 \
    }                                                                                           \
  } while (0)

struct cm_event { struct fi_eq_cm_entry entry; unsigned char data[256]; };

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IONBF, 0);
  if (argc != 7) {
    fprintf(stderr, "usage: %s HOST PORT REMOTE_ADDR KEY IMM MODE\n", argv[0]);
    return 2;
  }
  const uint64_t remote_addr = strtoull(argv[3], NULL, 0), key = strtoull(argv[4], NULL, 0);
  const uint64_t imm = strtoull(argv[5], NULL, 0);
  const char* mode = argv[6];

  struct fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_MSG;
  hints->caps = FI_MSG | FI_RMA | FI_WRITE;
  hints->fabric_attr->prov_name = strdup("tcp");
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY;
  struct fi_info* info = NULL;
  CHECK(fi_getinfo(FI_VERSION(1, 14), argv[1], argv[2], 0, hints, &info));
  struct fid_fabric* fabric; struct fid_domain* domain; struct fid_eq* eq; struct fid_cq* cq;
  struct fid_ep* ep; struct fid_mr* mr;
  struct fi_eq_attr eq_attr = {.wait_obj = FI_WAIT_UNSPEC};
  struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE};
  CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
  CHECK(fi_eq_open(fabric, &eq_attr, &eq, NULL));
  CHECK(fi_domain(fabric, info, &domain, NULL));
  CHECK(fi_cq_open(domain, &cq_attr, &cq, NULL));
  CHECK(fi_endpoint(domain, info, &ep, NULL));
  CHECK(fi_ep_bind(ep, &eq->fid, 0));
  CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_enable(ep));
  static char payload[64] = "PWNED PWNED PWNED PWNED PWNED PWNED PWNED PWNED PWNED PWNED PWN";
  CHECK(fi_mr_reg(domain, payload, sizeof payload, FI_WRITE, 0, 0, 0, &mr, NULL));

  /* crafted: the request's shape (version 1, the current time, ids, a nonce) with a made-up proof;
     junk: 56 random bytes; empty: no connection data at all. */
  unsigned char data[56];
  srand((unsigned)time(NULL));
  for (size_t i = 0; i < sizeof data; ++i) data[i] = (unsigned char)rand();
  size_t data_len = sizeof data;
  if (strcmp(mode, "crafted") == 0) {
    const uint32_t now = (uint32_t)time(NULL);
    data[0] = 1, data[1] = 0, data[2] = 0, data[3] = 0;
    data[4] = now >> 24, data[5] = now >> 16, data[6] = now >> 8, data[7] = now;
  } else if (strcmp(mode, "empty") == 0) {
    data_len = 0;
  } else if (strlen(mode) == 2 * sizeof data) {
    for (size_t i = 0; i < sizeof data; ++i) {
      unsigned int byte = 0;
      if (sscanf(mode + 2 * i, "%2x", &byte) != 1) {
        fprintf(stderr, "bad hex connection data\n");
        return 2;
      }
      data[i] = (unsigned char)byte;
    }
  }
  CHECK(fi_connect(ep, info->dest_addr, data_len ? data : NULL, data_len));
  struct cm_event ev;
  uint32_t event = 0;
  ssize_t n = fi_eq_sread(eq, &event, &ev, sizeof ev, 10000, 0);
  if (n == -FI_EAVAIL) {
    struct fi_eq_err_entry err = {0};
    fi_eq_readerr(eq, &err, 0);
    printf("refused err=%d (%s) reject_data=%zu reason=%d\n", err.err, fi_strerror(err.err), err.err_data_size,
           err.err_data_size ? ((unsigned char*)err.err_data)[0] : -1);
    return 0;
  }
  if (n < 0) {
    printf("no answer %zd (%s)\n", n, fi_strerror((int)-n));
    return 0;
  }
  printf("connected event=%u\n", event);
  CHECK(fi_writedata(ep, payload, sizeof payload, fi_mr_desc(mr), imm, 0, remote_addr, key, NULL));
  struct fi_cq_data_entry ce;
  int r = -FI_EAGAIN;
  for (int spins = 0; spins < 2000000 && (r = (int)fi_cq_read(cq, &ce, 1)) == -FI_EAGAIN; ++spins) {}
  printf("write completion %d\n", r);
  return 0;
}
