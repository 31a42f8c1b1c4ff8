import socket, sys, time
n, port, dur, gap = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
socks=[]
for i in range(n):
    try:
        s=socket.create_connection(("127.0.0.1",port), timeout=2)
        s.sendall(b"POST /php/upload.php HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        socks.append(s)
    except Exception as e: print("conn", i, e); break
print("opened", len(socks)); sys.stdout.flush()
t=time.time(); alive=len(socks)
while time.time()-t<dur:
    time.sleep(gap)
    for s in list(socks):
        try: s.sendall(b"1\r\na\r\n")
        except Exception: socks.remove(s)
print("alive at end", len(socks), "of", n)
