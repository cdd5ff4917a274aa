"""First-party edgeproxy plugins, importable as ``edgeproxy.plugins.<name>``.

Each is built only on the public hooks of :mod:`edgeproxy.hookspecs` and is
enabled like any third-party plugin::

    [plugins]
    enabled = ["edgeproxy.plugins.apikey_auth", "edgeproxy.plugins.access_log"]

    [plugins.settings.apikey_auth]
    keys_file = "/etc/edgeproxy/keys.txt"
"""
