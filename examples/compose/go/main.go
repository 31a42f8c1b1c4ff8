// A small Go API behind floodgate (standard library only): every request under /api/ is
// answered with JSON describing the client address the app sees.
//
//	LISTEN_ADDR=127.0.0.1:0 go run .    # port 0: the chosen address is printed on stdout
//
// Behind floodgate, RemoteAddr is floodgate's own connection; the client is in X-Real-IP
// (and the last X-Forwarded-For entry), which floodgate sets itself and a client cannot plant.
package main

import (
	"encoding/json"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"time"
)

type answer struct {
	App             string `json:"app"`
	Method          string `json:"method"`
	Path            string `json:"path"`
	Query           string `json:"query"`
	RemoteAddr      string `json:"remote_addr"`
	XForwardedFor   string `json:"x_forwarded_for"`
	XRealIP         string `json:"x_real_ip"`
	XForwardedProto string `json:"x_forwarded_proto"`
	XForwardedHost  string `json:"x_forwarded_host"`
	Via             string `json:"via"`
	APIKey          bool   `json:"api_key_present"`
}

func describe(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(answer{
		App:             "go",
		Method:          r.Method,
		Path:            r.URL.Path,
		Query:           r.URL.RawQuery,
		RemoteAddr:      r.RemoteAddr,
		XForwardedFor:   r.Header.Get("X-Forwarded-For"),
		XRealIP:         r.Header.Get("X-Real-IP"),
		XForwardedProto: r.Header.Get("X-Forwarded-Proto"),
		XForwardedHost:  r.Header.Get("X-Forwarded-Host"),
		Via:             r.Header.Get("Via"),
		APIKey:          r.Header.Get("X-Api-Key") != "",
	})
}

func main() {
	addr := os.Getenv("LISTEN_ADDR")
	if addr == "" {
		addr = ":8080"
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/api/", describe)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})

	listener, err := net.Listen("tcp", addr)
	if err != nil {
		log.Fatalf("listen %s: %v", addr, err)
	}
	// Tests and scripts read the real address (port 0 picks a free one) from this line.
	fmt.Printf("go-app listening on %s\n", listener.Addr())

	server := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       90 * time.Second,
	}
	log.Fatal(server.Serve(listener))
}
