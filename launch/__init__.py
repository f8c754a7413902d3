"""The launchers: `baton up`'s local cluster of real processes, the in-process engine behind `baton generate --local`, and several hosts on one machine (network namespaces)."""
