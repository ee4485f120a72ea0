"""Tools above the library: `simulate` (one rank of an N-rank job in this process) and `explain`
(each op's placements and the reshards it caused).  They observe the core through its declared
interfaces and are never imported by it."""
