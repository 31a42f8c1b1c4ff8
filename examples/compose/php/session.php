<?php
// A PHP session behind floodgate's sticky balancing (balance = "hash" on the PHPSESSID
// cookie): counts the requests of this session and says which server answered.
//
//   GET /session.php   JSON: {"app": "php", "server": "php-a", "session": "<id>", "n": 3}
//
// `server` is APP_SERVER from the environment (docker-compose.yml sets php-a and php-b),
// else the host name and port. Sessions are PHP's default: files in session.save_path, so
// a session lives on the server that wrote it unless the servers share that directory.
// `n` is 1 for a new session (or one whose data this server does not have) and counts up
// from there.

session_start();
$_SESSION['n'] = ($_SESSION['n'] ?? 0) + 1;

$server = getenv('APP_SERVER');
if ($server === false || $server === '') {
    $server = gethostname() . ':' . ($_SERVER['SERVER_PORT'] ?? '?');
}

header('Content-Type: application/json');
echo json_encode([
    'app' => 'php',
    'server' => $server,
    'session' => session_id(),
    'n' => $_SESSION['n'],
    'HTTP_X_REAL_IP' => $_SERVER['HTTP_X_REAL_IP'] ?? null,
], JSON_PRETTY_PRINT | JSON_UNESCAPED_SLASHES), "\n";
