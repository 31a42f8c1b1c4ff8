<?php
// A legacy login form behind floodgate's login protection (gateway.toml: the `login`
// route and the `login_failures` limit, count = "failures"). The app itself does nothing
// against password guessing; it only answers a failed login with 401, which floodgate
// counts: the fifth failure within 15 minutes locks the client's address out for an hour,
// and its next attempts are refused by floodgate (429) without reaching PHP.
//
//   POST /login.php  user=demo&password=floodgate-demo   200, JSON {"app": "php", "login": "ok", ...}
//   POST /login.php  user=demo&password=wrong            401, JSON {"app": "php", "login": "failed", ...}
//   GET  /login.php?user=...&password=...                the same (for trying it with curl)
//   GET  /login.php                                      the form
//
// The credentials are fixed demo values. A real app checks a password hash
// (password_verify) and keeps answering failures with 401 (or 403): floodgate sees only
// the status, so a failure answered with 200 and an error page would not be counted.

const DEMO_USER = 'demo';
const DEMO_PASSWORD = 'floodgate-demo';

$user = $_POST['user'] ?? $_GET['user'] ?? null;
$password = $_POST['password'] ?? $_GET['password'] ?? null;

header('Cache-Control: no-store');

if ($user === null && $password === null && $_SERVER['REQUEST_METHOD'] === 'GET') {
    header('Content-Type: text/html; charset=utf-8');
    echo <<<'HTML'
<!doctype html>
<title>Log in</title>
<form method="post" action="/login.php">
  <label>User <input name="user" autocomplete="username"></label>
  <label>Password <input name="password" type="password" autocomplete="current-password"></label>
  <button>Log in</button>
</form>

HTML;
    exit;
}

$ok = is_string($user) && is_string($password)
    && hash_equals(DEMO_USER, $user)
    && hash_equals(DEMO_PASSWORD, $password);

http_response_code($ok ? 200 : 401);
header('Content-Type: application/json');
echo json_encode([
    'app' => 'php',
    'login' => $ok ? 'ok' : 'failed',
    'user' => is_string($user) ? $user : null,
    'HTTP_X_REAL_IP' => $_SERVER['HTTP_X_REAL_IP'] ?? null,
], JSON_PRETTY_PRINT | JSON_UNESCAPED_SLASHES), "\n";
