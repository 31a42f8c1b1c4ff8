<?php
// A form with a file upload. GET: the HTML form. POST: JSON echoing every field and, for
// each uploaded file, its name, size, MD5 and SHA-256, so that a caller can check that the
// body reached PHP intact through floodgate.

if ($_SERVER['REQUEST_METHOD'] !== 'POST') {
    header('Content-Type: text/html; charset=utf-8');
    ?>
<!doctype html>
<title>floodgate example form</title>
<form method="post" action="/form.php" enctype="multipart/form-data">
  <p><label>Name <input name="name" value="Ada"></label></p>
  <p><label>Comment <textarea name="comment">Hello through floodgate</textarea></label></p>
  <p><label>File <input type="file" name="upload"></label></p>
  <p><button>Send</button></p>
</form>
<?php
    exit;
}

$files = [];
foreach ($_FILES as $field => $file) {
    $ok = $file['error'] === UPLOAD_ERR_OK;
    $files[$field] = [
        'name' => $file['name'],
        'size' => $ok ? filesize($file['tmp_name']) : 0,
        'md5' => $ok ? md5_file($file['tmp_name']) : null,
        'sha256' => $ok ? hash_file('sha256', $file['tmp_name']) : null,
        'error' => $file['error'],
    ];
}

header('Content-Type: application/json');
echo json_encode([
    'app' => 'php',
    'content_type' => $_SERVER['CONTENT_TYPE'] ?? null,
    'fields' => $_POST,
    'files' => (object) $files,
    'HTTP_X_REAL_IP' => $_SERVER['HTTP_X_REAL_IP'] ?? null,
], JSON_PRETTY_PRINT | JSON_UNESCAPED_SLASHES), "\n";
