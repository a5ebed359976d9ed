/* tcp FI_EP_MSG: connection set-up carrying a proof in the CM data, fi_reject of a bad one,
   fi_accept with the server's own proof, then fi_writedata with remote CQ data on the accepted one. */
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
#include <sys/wait.h>
#include <unistd.h>
#define CK(x) do { int _r = (int)(x); if (_r < 0) { fprintf(stderr, "%s:%d %s = %d (%s)\n", __FILE__, __LINE__, #x, _r, fi_strerror(-_r)); exit(1); } } while (0)
#define PORT 47911
static struct fi_info *getinfo(int server) {
    struct fi_info *hints = fi_allocinfo(), *info;
    hints->ep_attr->type = FI_EP_MSG;
    hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->fabric_attr->prov_name = strdup("tcp");
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED;  /* what we are prepared to honour */
    char port[8]; snprintf(port, sizeof port, "%d", PORT);
    CK(fi_getinfo(FI_VERSION(1, 17), "127.0.0.1", port, server ? FI_SOURCE : 0, hints, &info));
    fi_freeinfo(hints);
    return info;
}
struct cm { struct fi_eq_cm_entry e; char data[256]; };
static void client(const char *proof) {
    struct fi_info *info = getinfo(0); struct fid_fabric *fab; struct fid_domain *dom; struct fid_eq *eq;
    struct fid_ep *ep; struct fid_cq *cq; struct fid_mr *mr; static char buf[64] = "written by the authenticated peer";
    struct fi_eq_attr eqa = {.wait_obj = FI_WAIT_UNSPEC}; struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_DATA};
    CK(fi_fabric(info->fabric_attr, &fab, NULL)); CK(fi_eq_open(fab, &eqa, &eq, NULL));
    CK(fi_domain(fab, info, &dom, NULL)); CK(fi_endpoint(dom, info, &ep, NULL)); CK(fi_cq_open(dom, &cqa, &cq, NULL));
    CK(fi_ep_bind(ep, &eq->fid, 0)); CK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(ep));
    CK(fi_mr_reg(dom, buf, sizeof buf, FI_WRITE, 0, 0, 0, &mr, NULL));
    CK(fi_connect(ep, info->dest_addr, proof, strlen(proof) + 1));
    struct cm c; uint32_t ev; ssize_t n = fi_eq_sread(eq, &ev, &c, sizeof c, 5000, 0);
    if (n == -FI_EAVAIL) {
        struct fi_eq_err_entry err = {0}; fi_eq_readerr(eq, &err, 0);
        printf("client[%s]: refused: err=%d (%s), reject data %zu bytes: '%.*s'\n", proof, err.err, fi_strerror(err.err),
               err.err_data_size, (int)err.err_data_size, (char *)err.err_data);
        return;
    }
    CK(n);
    printf("client[%s]: event %s, accept data %zd bytes: '%s'\n", proof, ev == FI_CONNECTED ? "FI_CONNECTED" : "?",
           n - (ssize_t)sizeof(struct fi_eq_cm_entry), c.data);
    /* tcp reports no FI_MR_VIRT_ADDR: the remote address is an offset into the region; the key is the server's */
    CK(fi_writedata(ep, buf, sizeof buf, fi_mr_desc(mr), 0xC0FFEE, 0, 0, 0x5eed1234abcdULL, NULL));
    struct fi_cq_data_entry ce; int r; while ((r = fi_cq_read(cq, &ce, 1)) == -FI_EAGAIN) ;
    printf("client[%s]: write completed (%d)\n", proof, r); sleep(1);
}
int main(void) { setvbuf(stdout, NULL, _IONBF, 0);
    struct fi_info *info = getinfo(1); struct fid_fabric *fab; struct fid_domain *dom; struct fid_eq *eq;
    struct fid_pep *pep; struct fid_cq *cq; struct fid_mr *mr; static char region[4096];
    struct fi_eq_attr eqa = {.wait_obj = FI_WAIT_UNSPEC}; struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_DATA};
    printf("provider %s, ep_type %d (MSG=%d), mr_mode 0x%x, FI_MR_PROV_KEY %s\n", info->fabric_attr->prov_name,
           info->ep_attr->type, FI_EP_MSG, info->domain_attr->mr_mode, info->domain_attr->mr_mode & FI_MR_PROV_KEY ? "yes" : "no");
    CK(fi_fabric(info->fabric_attr, &fab, NULL)); CK(fi_eq_open(fab, &eqa, &eq, NULL));
    CK(fi_passive_ep(fab, info, &pep, NULL)); CK(fi_pep_bind(pep, &eq->fid, 0)); CK(fi_listen(pep));
    size_t cmsz = 0, len = sizeof cmsz; CK(fi_getopt(&pep->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &cmsz, &len));
    printf("server: FI_OPT_CM_DATA_SIZE = %zu bytes\n", cmsz);
    CK(fi_domain(fab, info, &dom, NULL)); CK(fi_cq_open(dom, &cqa, &cq, NULL));
    CK(fi_mr_reg(dom, region, sizeof region, FI_REMOTE_WRITE, 0, 0x5eed1234abcdULL, 0, &mr, NULL));
    printf("server: MR key %s: 0x%llx\n", info->domain_attr->mr_mode & FI_MR_PROV_KEY ? "provider-chosen" : "as requested",
           (unsigned long long)fi_mr_key(mr));
    const char *proofs[] = {"forged-proof", "GOOD-HMAC"};
    for (int i = 0; i < 2; i++) {
        if (fork() == 0) { client(proofs[i]); _exit(0); }
        struct cm c; uint32_t ev; CK(fi_eq_sread(eq, &ev, &c, sizeof c, 5000, 0));
        struct sockaddr_in *sa = (struct sockaddr_in *)c.e.info->dest_addr;
        printf("server: FI_CONNREQ(%d) from %s:%d (the socket's peer) with CM data '%s'\n", ev == FI_CONNREQ,
               inet_ntoa(sa->sin_addr), ntohs(sa->sin_port), c.data);
        if (strcmp(c.data, "GOOD-HMAC") != 0) {
            CK(fi_reject(pep, c.e.info->handle, "bad proof", 10)); fi_freeinfo(c.e.info);
            printf("server: rejected\n"); wait(NULL); continue;
        }
        struct fid_ep *ep; CK(fi_endpoint(dom, c.e.info, &ep, NULL)); CK(fi_ep_bind(ep, &eq->fid, 0));
        CK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(ep));
        CK(fi_accept(ep, "SERVER-HMAC", 12)); CK(fi_eq_sread(eq, &ev, &c, sizeof c, 5000, 0));
        printf("server: event %s\n", ev == FI_CONNECTED ? "FI_CONNECTED" : "?");
        struct fi_cq_data_entry ce; int r;
        for (int t = 0; (r = fi_cq_read(cq, &ce, 1)) == -FI_EAGAIN && t < 5000000; t++) ;
        printf("server: cq %d flags remote_write=%d remote_cq_data=%d data=0x%llx; region: '%s'\n", r,
               !!(ce.flags & FI_REMOTE_WRITE), !!(ce.flags & FI_REMOTE_CQ_DATA), (unsigned long long)ce.data, region);
        wait(NULL);
    }
    return 0;
}
