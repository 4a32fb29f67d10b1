package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// Registration proxy: an opt-in workaround, off by default.
//
// kubelet 1.36's plugin manager dials registration sockets with grpc.DialContext(<socket path>) and no
// WithAuthority, so grpc-go sends `:authority: %2Fvar%2Flib%2Fkubelet%2F...-reg.sock`. hyper's h2 (used
// by tonic) rejects that authority with PROTOCOL_ERROR, so a tonic-based plugin cannot register with a
// real kubelet. With --registration-proxy-from the plugin registers in a private directory and this proxy
// re-exposes each `*-reg.sock` in the watched registry directory, forwarding to the plugin with
// `:authority: localhost`. It exists only to exercise the rest of the driver while that bug is open; the
// default path is kubelet's own.

type regProxy struct {
	from, to string
	mu       sync.Mutex
	served   map[string]*proxiedSocket
}

type proxiedSocket struct {
	ino    uint64
	mtime  time.Time
	server *grpc.Server
	conn   *grpc.ClientConn
}

type forwarder struct {
	registerapi.UnimplementedRegistrationServer
	client registerapi.RegistrationClient
}

func (f *forwarder) GetInfo(ctx context.Context, req *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return f.client.GetInfo(ctx, req)
}

func (f *forwarder) NotifyRegistrationStatus(ctx context.Context, req *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	return f.client.NotifyRegistrationStatus(ctx, req)
}

func runRegistrationProxy(ctx context.Context, from, to string) {
	p := &regProxy{from: from, to: to, served: map[string]*proxiedSocket{}}
	klog.InfoS("Registration proxy enabled (workaround for tonic servers rejecting kubelet's :authority)", "from", from, "to", to)
	ticker := time.NewTicker(300 * time.Millisecond)
	defer ticker.Stop()
	for {
		p.sync()
		select {
		case <-ctx.Done():
			p.mu.Lock()
			for name := range p.served {
				p.stop(name)
			}
			p.mu.Unlock()
			return
		case <-ticker.C:
		}
	}
}

func (p *regProxy) sync() {
	p.mu.Lock()
	defer p.mu.Unlock()
	entries, _ := os.ReadDir(p.from)
	seen := map[string]bool{}
	for _, en := range entries {
		name := en.Name()
		if !strings.HasSuffix(name, "-reg.sock") || strings.HasPrefix(name, ".") {
			continue
		}
		info, err := os.Stat(filepath.Join(p.from, name))
		if err != nil || info.Mode()&os.ModeSocket == 0 {
			continue
		}
		seen[name] = true
		ino := info.Sys().(*syscall.Stat_t).Ino
		if cur := p.served[name]; cur != nil && cur.ino == ino && cur.mtime.Equal(info.ModTime()) {
			continue
		}
		// New or recreated plugin socket: a fresh proxy socket, so kubelet re-registers as it would.
		p.stop(name)
		conn, err := grpc.NewClient("unix:"+filepath.Join(p.from, name), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			klog.ErrorS(err, "Registration proxy: dial plugin", "socket", name)
			continue
		}
		target := filepath.Join(p.to, name)
		_ = os.Remove(target)
		lis, err := net.Listen("unix", target)
		if err != nil {
			conn.Close()
			klog.ErrorS(err, "Registration proxy: listen", "socket", target)
			continue
		}
		srv := grpc.NewServer()
		registerapi.RegisterRegistrationServer(srv, &forwarder{client: registerapi.NewRegistrationClient(conn)})
		go func() { _ = srv.Serve(lis) }()
		p.served[name] = &proxiedSocket{ino: ino, mtime: info.ModTime(), server: srv, conn: conn}
		klog.InfoS("Registration proxy: serving", "socket", target)
	}
	for name := range p.served {
		if !seen[name] {
			p.stop(name)
		}
	}
}

func (p *regProxy) stop(name string) {
	cur := p.served[name]
	if cur == nil {
		return
	}
	cur.server.Stop()
	cur.conn.Close()
	_ = os.Remove(filepath.Join(p.to, name))
	delete(p.served, name)
	klog.InfoS("Registration proxy: stopped", "socket", name)
}
