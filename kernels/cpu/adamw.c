/* adamw.c: CPU kernels (stub: not implemented yet). */
#include "cpu.h"

lunar_status lunar_cpu_adamw_step(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master, lunar_tensor *m, lunar_tensor *v, const lunar_tensor *grad, const lunar_adamw_hparams *hp) {
    (void)param;
    (void)master;
    (void)m;
    (void)v;
    (void)grad;
    (void)hp;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "adamw_step is not implemented on the cpu backend yet");
}
