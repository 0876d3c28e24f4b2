"""The target side: verification of draft blocks (greedy and exact rejection sampling) over the
target's paged KV pool. Runs in the target worker's process (and the caller's, in-process mode);
the sessions around it are coordinator/session/.

May import: svip_common only."""
