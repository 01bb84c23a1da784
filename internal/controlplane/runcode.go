package controlplane

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"sort"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
)

// fncall through the server (issue 6): FnService.RunCode, and the same
// call as SandboxFusion's POST /run_code (JSON), so trainers written for
// SandboxFusion switch by changing a URL. The server picks a node (least
// queued, preferring one holding the image's layers) and the node runs the
// call in a clean sandbox from its pool.

// runCodeSlack is added to a call's compile and run time limits for its
// edge call: sandbox hand-out, file transfer and a queue wait.
const runCodeSlack = 30 * time.Second

// anonymous is the identity of tokenless /run_code callers from the
// configured open networks: it sees public images only.
var anonymous = iam.Principal{Tenant: iam.AnonymousTenant}

type fnService struct{ s *Server }

func (fs *fnService) RunCode(ctx context.Context, req *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	res, err := fs.s.runCode(ctx, p, req.Msg)
	if err != nil {
		fs.s.metrics.fail("run_code", err)
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *Server) runCode(ctx context.Context, p iam.Principal, r *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	if err := validDuration("compile_timeout", r.GetCompileTimeout()); err != nil {
		return nil, err
	}
	if err := validDuration("run_timeout", r.GetRunTimeout()); err != nil {
		return nil, err
	}
	fr := fncall.Request{
		Code: r.GetCode(), Language: r.GetLanguage(), MemoryLimitMB: r.GetMemoryLimitMb(), Stdin: r.GetStdin(),
		Files: r.GetFiles(), FetchFiles: r.GetFetchFiles(), Args: r.GetArgs(), MaxOutputBytes: r.GetMaxOutputBytes(),
		CompileTimeout: r.GetCompileTimeout().AsDuration(), RunTimeout: r.GetRunTimeout().AsDuration(),
	}
	if err := fr.Validate(); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	lang, err := fncall.Lookup(r.GetLanguage())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	ref := r.GetImage()
	if ref == "" {
		ref = lang.Image
	}
	internal, m, _, err := s.resolveImage(ctx, p, "image", ref)
	if err != nil {
		if connect.CodeOf(err) == connect.CodeNotFound && r.GetImage() == "" {
			return nil, errf(connect.CodeNotFound, "image %q of language %s not found: `make up` builds and imports it in the background (it says when it is ready); by hand: `make lang-image`, then `dsec image import --public --server-path %s /var/cache/dsec/lang-rootfs`", ref, lang.Name, ref)
		}
		return nil, err
	}
	layers := make([]string, len(m.Layers))
	for i, l := range m.Layers {
		layers[i] = l.Digest
	}
	node, url, ok := s.reg.fnNode(layers)
	if !ok {
		return nil, errf(connect.CodeUnavailable, "no live node runs the container backend fncall needs")
	}
	limit := max(fr.CompileTimeout, 0) + max(fr.RunTimeout, 0)
	if limit == 0 {
		limit = fncall.DefaultCompileTimeout + fncall.DefaultRunTimeout
	}
	cctx, cancel := callContext(ctx, limit+runCodeSlack)
	defer cancel()
	resp, err := s.edges.get(url).RunCodeOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeRunCodeRequest{
		Caller: callerOf(p), Request: r, Image: internal,
	}))
	if err != nil {
		if unreachable(err) && connect.CodeOf(err) != connect.CodeUnavailable && ctx.Err() == nil {
			// The node failed under the call: an infrastructure fault,
			// reported in the body as SandboxFusion does.
			return &dsecv1.RunCodeResponse{Status: fncall.StatusSandboxError, Message: edgeFault(node, err)}, nil
		}
		return nil, err
	}
	return resp.Msg, nil
}

// fnNode picks the node for one call: among live nodes offering the
// container backend, the fewest queued calls, then the most of the image's
// layers held, then the least load.
func (r *registry) fnNode(layers []string) (id, url string, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	type cand struct {
		n     *node
		held  int
		score float64
	}
	var best *cand
	for _, n := range r.nodes {
		if !r.alive(n, now) {
			continue
		}
		if _, offers := n.capacity["container"]; !offers {
			continue
		}
		c := cand{n: n}
		for _, l := range layers {
			if _, ok := n.layers[l]; ok {
				c.held++
			}
		}
		c.score = float64(n.queued)*10 + n.load - float64(c.held)
		if best == nil || c.score < best.score || (c.score == best.score && n.id < best.n.id) {
			best = &c
		}
	}
	if best == nil {
		return "", "", false
	}
	return best.n.id, best.n.url, true
}

// ---------------------------------------------------------------- /run_code

// fusionRequest is SandboxFusion's RunCodeRequest. Timeouts are seconds;
// files are base64; memory_limit_MB <= 0 means the language's default.
type fusionRequest struct {
	Code           string             `json:"code"`
	Language       string             `json:"language"`
	CompileTimeout *float64           `json:"compile_timeout"`
	RunTimeout     *float64           `json:"run_timeout"`
	MemoryLimitMB  *int64             `json:"memory_limit_MB"`
	Stdin          *string            `json:"stdin"`
	Files          map[string]*string `json:"files"`
	FetchFiles     []string           `json:"fetch_files"`
	Args           []string           `json:"args"`
	// Image is DSec's addition: run in this image instead of the
	// language's (as RunCodeRequest.image).
	Image string `json:"image"`
}

// fusionFields are the fields a /run_code body may have; any other is
// refused rather than silently ignored (an ignored "image" ran the call in
// the default image).
const fusionFields = "code, language, compile_timeout, run_timeout, memory_limit_MB, stdin, files, fetch_files, args, image"

// fusionCommand is SandboxFusion's CommandRunResult.
type fusionCommand struct {
	Status        string   `json:"status"`
	ExecutionTime *float64 `json:"execution_time"`
	ReturnCode    *int32   `json:"return_code"`
	Stdout        *string  `json:"stdout"`
	Stderr        *string  `json:"stderr"`
}

// fusionResponse is SandboxFusion's RunCodeResponse.
type fusionResponse struct {
	Status          string            `json:"status"`
	Message         string            `json:"message"`
	CompileResult   *fusionCommand    `json:"compile_result"`
	RunResult       *fusionCommand    `json:"run_result"`
	ExecutorPodName *string           `json:"executor_pod_name"`
	Files           map[string]string `json:"files"`
}

// maxRunCodeBody bounds a /run_code request body.
const maxRunCodeBody = 64 << 20

func seconds(field string, v *float64) (*durationpb.Duration, error) {
	if v == nil {
		return nil, nil
	}
	if math.IsNaN(*v) || math.IsInf(*v, 0) || *v < 0 || *v > 24*3600 {
		return nil, fmt.Errorf("%s: %v is not a number of seconds in [0, 86400]", field, *v)
	}
	return durationpb.New(time.Duration(*v * float64(time.Second))), nil
}

// toProto turns a /run_code body into the API's request.
func (f *fusionRequest) toProto() (*dsecv1.RunCodeRequest, error) {
	r := &dsecv1.RunCodeRequest{Code: f.Code, Language: f.Language, FetchFiles: f.FetchFiles, Args: f.Args, Image: f.Image}
	var err error
	if r.CompileTimeout, err = seconds("compile_timeout", f.CompileTimeout); err != nil {
		return nil, err
	}
	if r.RunTimeout, err = seconds("run_timeout", f.RunTimeout); err != nil {
		return nil, err
	}
	if f.MemoryLimitMB != nil && *f.MemoryLimitMB > 0 {
		r.MemoryLimitMb = *f.MemoryLimitMB
	}
	if f.Stdin != nil {
		r.Stdin = []byte(*f.Stdin)
	}
	if len(f.Files) > 0 {
		r.Files = make(map[string][]byte, len(f.Files))
		for name, b64 := range f.Files {
			if b64 == nil {
				continue
			}
			data, err := base64.StdEncoding.DecodeString(*b64)
			if err != nil {
				return nil, fmt.Errorf("files[%q]: not base64: %v", name, err)
			}
			r.Files[name] = data
		}
	}
	return r, nil
}

func fusionCommandOf(c *dsecv1.CommandResult) *fusionCommand {
	if c == nil {
		return nil
	}
	t, code := c.GetExecutionTime(), c.GetReturnCode()
	out, errOut := string(c.GetStdout()), string(c.GetStderr())
	fc := &fusionCommand{Status: c.GetStatus(), ExecutionTime: &t, Stdout: &out, Stderr: &errOut}
	if c.GetStatus() != fncall.CommandError {
		fc.ReturnCode = &code
	}
	return fc
}

func fusionResponseOf(r *dsecv1.RunCodeResponse) *fusionResponse {
	out := &fusionResponse{
		Status: r.GetStatus(), Message: r.GetMessage(),
		CompileResult: fusionCommandOf(r.GetCompileResult()), RunResult: fusionCommandOf(r.GetRunResult()),
		Files: map[string]string{},
	}
	names := make([]string, 0, len(r.GetFiles()))
	for n := range r.GetFiles() {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		out.Files[n] = base64.StdEncoding.EncodeToString(r.GetFiles()[n])
	}
	return out
}

// runCodePrincipal authenticates a /run_code call: a bearer token, or none
// from a configured open network.
func (s *Server) runCodePrincipal(r *http.Request) (iam.Principal, error) {
	if r.Header.Get("Authorization") != "" || len(s.cfg.RunCodeOpen) == 0 {
		tok, ok := iam.BearerToken(r.Header.Get("Authorization"))
		if !ok {
			return iam.Principal{}, connect.NewError(connect.CodeUnauthenticated, errors.New("missing Authorization: Bearer <token> header (this server accepts /run_code without a token from no network)"))
		}
		p, err := s.iam.Authenticate(r.Context(), tok)
		if errors.Is(err, iam.ErrUnauthenticated) {
			return iam.Principal{}, connect.NewError(connect.CodeUnauthenticated, err)
		}
		if err != nil {
			return iam.Principal{}, connect.NewError(connect.CodeUnavailable, err)
		}
		return p, nil
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	addr, err := netip.ParseAddr(host)
	if err == nil {
		addr = addr.Unmap()
		for _, pfx := range s.cfg.RunCodeOpen {
			if pfx.Contains(addr) {
				return anonymous, nil
			}
		}
	}
	return iam.Principal{}, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("missing Authorization: Bearer <token> header (tokenless /run_code is open to %v only, not %s)", s.cfg.RunCodeOpen, host))
}

// httpStatus maps a Connect code to the HTTP status of a /run_code reply.
func httpStatus(code connect.Code) int {
	switch code {
	case connect.CodeInvalidArgument:
		return http.StatusBadRequest
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeResourceExhausted:
		return http.StatusTooManyRequests
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// serveRunCode is POST /run_code.
func (s *Server) serveRunCode(w http.ResponseWriter, r *http.Request) {
	reply := func(status int, body any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(body)
	}
	fail := func(err error) {
		s.metrics.fail("run_code", err)
		var ce *connect.Error
		if errors.As(err, &ce) {
			if ra := ce.Meta().Get("Retry-After"); ra != "" {
				w.Header().Set("Retry-After", ra)
			}
		}
		// SandboxFusion's shape, so clients that parse only it still get
		// a status and a reason.
		reply(httpStatus(connect.CodeOf(err)), &fusionResponse{Status: fncall.StatusSandboxError, Message: s.redact.Error(err).Error(), Files: map[string]string{}})
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		reply(http.StatusMethodNotAllowed, &fusionResponse{Status: fncall.StatusSandboxError, Message: "use POST /run_code with a JSON body", Files: map[string]string{}})
		return
	}
	p, err := s.runCodePrincipal(r)
	if err != nil {
		fail(err)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxRunCodeBody))
	if err != nil {
		fail(errf(connect.CodeInvalidArgument, "read body: %w", err))
		return
	}
	var fr fusionRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&fr); err != nil {
		if field, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
			fail(errf(connect.CodeInvalidArgument, "body: unknown field %s (a run_code body has %s)", field, fusionFields))
			return
		}
		fail(errf(connect.CodeInvalidArgument, "body is not a run_code JSON object: %w", err))
		return
	}
	if dec.More() {
		fail(errf(connect.CodeInvalidArgument, "body: more than one JSON value"))
		return
	}
	req, err := fr.toProto()
	if err != nil {
		fail(connect.NewError(connect.CodeInvalidArgument, err))
		return
	}
	res, err := s.runCode(r.Context(), p, req)
	if err != nil {
		fail(err)
		return
	}
	reply(http.StatusOK, fusionResponseOf(res))
}
