"""CPU kernels of Baton's own, built from C on first use with the machine's compiler."""
