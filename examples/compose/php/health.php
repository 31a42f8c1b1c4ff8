<?php
// floodgate's active health check (health_check.path in gateway.toml): 200 "ok" whenever
// this server can run PHP at all. It touches no session and no database on purpose: a
// check that fails when a shared dependency is down would take every server out at once.

header('Content-Type: text/plain');
header('Cache-Control: no-store');
echo "ok\n";
