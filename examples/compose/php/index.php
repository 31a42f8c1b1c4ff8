<?php
// The legacy PHP app behind floodgate: shows the client address as PHP sees it.
//
//   GET /           JSON: REMOTE_ADDR, HTTP_X_FORWARDED_FOR, HTTP_X_REAL_IP and every HTTP_* variable
//   GET /?sleep=3   the same, after sleeping 3 seconds (a slow page; floodgate answers 504
//                   when the upstream's `timeout` is shorter)
//   /form.php       a form with a file upload
//
// floodgate speaks FastCGI to PHP-FPM and gives REMOTE_ADDR as the client it decided (its
// trusted_proxies applied), as HTTP_X_REAL_IP and the last HTTP_X_FORWARDED_FOR entry: a
// client cannot plant any of them, not even as `X_Forwarded_For` (PHP would read that
// spelling as the same variable; floodgate drops headers with underscores).

$sleep = isset($_GET['sleep']) ? (int) $_GET['sleep'] : 0;
if ($sleep > 0) {
    sleep(min($sleep, 30));
}

$headers = [];
foreach ($_SERVER as $name => $value) {
    if (strncmp($name, 'HTTP_', 5) === 0) {
        $headers[$name] = $value;
    }
}
ksort($headers);

header('Content-Type: application/json');
echo json_encode([
    'app' => 'php',
    'method' => $_SERVER['REQUEST_METHOD'],
    'uri' => $_SERVER['REQUEST_URI'],
    'slept' => $sleep,
    'REMOTE_ADDR' => $_SERVER['REMOTE_ADDR'] ?? null,
    'HTTP_X_FORWARDED_FOR' => $_SERVER['HTTP_X_FORWARDED_FOR'] ?? null,
    'HTTP_X_REAL_IP' => $_SERVER['HTTP_X_REAL_IP'] ?? null,
    'headers' => $headers,
], JSON_PRETTY_PRINT | JSON_UNESCAPED_SLASHES), "\n";
