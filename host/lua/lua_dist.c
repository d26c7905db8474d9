/* lua_dist.c: collectives (stub: process hooks only, for now). */
#include <stdlib.h>

#include <mpi.h>

#include "lua_lunar.h"

static int env_int(const char *const *names, int def) {
    for (; *names; names++) {
        const char *v = getenv(*names);
        if (v && *v) return atoi(v);
    }
    return def;
}

int lunar_dist_env_rank(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", NULL};
    return env_int(names, 0);
}

int lunar_dist_env_size(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", NULL};
    return env_int(names, 1);
}

void lunar_dist_finalize(void) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (init && !fin) MPI_Finalize();
}

void lunar_dist_abort(int code) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (init && !fin) MPI_Abort(MPI_COMM_WORLD, code);
}

void lunar_lua_open_dist(lua_State *L) { (void)L; }
