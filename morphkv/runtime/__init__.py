"""What every command shares at run time: start-up (quiet Ctrl-C, OpenBLAS preload), argument
types, and the cache flags that become a ``KVCacheConfig``. Imports only ``core``/``mlxlm``/
``model``."""
