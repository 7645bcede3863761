/* strata_mpi.h - the MPI communicator, an add-on: link with -lstrata_mpi and your MPI
 * (pkg-config strata-mpi). libstrata itself depends on no MPI. */
#ifndef STRATA_MPI_H
#define STRATA_MPI_H

#include "strata_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A communicator over an MPI communicator: mpi_comm points to an MPI_Comm (NULL:
 * MPI_COMM_WORLD; MPI must be initialised). It is duplicated, so strata's traffic never
 * mixes with the caller's; collectives honour strata_comm_set_timeout.
 * Errors: STRATA_EINVAL (MPI not initialised), STRATA_ENOMEM, STRATA_EABORTED. */
int strata_comm_mpi(strata_comm **out, const void *mpi_comm);

#ifdef __cplusplus
}
#endif
#endif /* STRATA_MPI_H */
