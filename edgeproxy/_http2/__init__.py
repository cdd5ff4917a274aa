"""HTTP/2 as both ends of the proxy speak it: the listener (:mod:`edgeproxy._server`) and
the upstream pools (:mod:`edgeproxy._upstream`) share its frames (:mod:`.frames`), its
header fields' rules (:mod:`.fields`), the protocol engine's setup (:mod:`.engine`) and
the steps done without it on the fast paths: flow-control windows, DATA and HEADERS
(:mod:`.windows`), and a connection's writes (:mod:`.writes`).

Below the server and upstream layers: nothing here knows a pool, a listener or a request's
pipeline.
"""
