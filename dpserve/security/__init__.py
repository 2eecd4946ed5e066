"""Who may talk to the coordinator and to the HTTP front, one module per job:

- ``key_files``: the credentials directory, key files (the one parser of their text), loading them;
- ``roles``: which messages each role may send, the ZAP authenticator that gives each CURVE
  connection its role, and making sockets CURVE servers and clients;
- ``bind``: where a coordinator without credentials may listen;
- ``throwaway``: the fresh keys of one ``dpserve serve``, and finding them again;
- ``api_tokens``: the HTTP front's bearer tokens.

The coordinator receives each message with its connection's role in
``dpserve.coordinator.transport``. See docs/security.md.
"""
