package natsconf

import (
	"cmp"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// Account is one account of a decentralized setup.
type Account struct {
	// Name is the account's name in its JWT: SYS, BUILDQ or
	// TenantAccount(Tenant). The server knows the account by Key's public
	// key.
	Name string
	// Tenant is the tenant's name; empty for SYS and BUILDQ.
	Tenant string
	// Key is the account's identity key pair (with its seed): it signs the
	// account's user JWTs and, for BUILDQ, the tenants' activation tokens.
	Key nkeys.KeyPair
	// JWT is the account's JWT, signed by the operator.
	JWT string
}

// PublicKey is the account's public key (A…), the name the server knows it by.
func (a Account) PublicKey() string {
	pub, _ := a.Key.PublicKey()
	return pub
}

// JWTSetup is a decentralized (operator/JWT) setup: the operator, the
// system account, BUILDQ and one account per tenant, each with its key and
// its JWT.
//
// BUILDQ's exports are wildcards and private (they need an activation
// token): services buildq.requests.*, buildq.api.status.*,
// buildq.api.cancel.*, buildq.api.logs.*, buildq.api.results.*,
// buildq.cancel.*.* and streams buildq.results.*.>, buildq.events.*.>.
// The build logs themselves (buildq.logs.>, the BUILDQ_LOGS stream), the
// stored results (BUILDQ_RESULTS) and the JetStream API are not
// exported: a tenant reads a log only through its logs service, and
// what it missed of its results through its stored-results service.
// Tenant T's account imports TenantServices(T) and
// TenantStreams(T), each with an activation token that BUILDQ's key signed
// for T's account and exactly that subject; the server refuses an import
// whose subject is not contained in its token's. So a new tenant is one new
// account JWT: BUILDQ's does not change.
type JWTSetup struct {
	Operator    nkeys.KeyPair
	OperatorJWT string
	System      Account
	Buildq      Account
	// Tenants in the order they were added.
	Tenants []Account
}

// NewJWTSetup makes new keys for an operator, the system account and
// BUILDQ, signs their JWTs, and adds the tenants.
func NewJWTSetup(tenants []string) (*JWTSetup, error) {
	if err := CheckTenants(tenants); err != nil {
		return nil, err
	}
	op, err := nkeys.CreateOperator()
	if err != nil {
		return nil, err
	}
	s := &JWTSetup{Operator: op}
	if s.System, err = s.newAccount(SystemAccount, "", nil); err != nil {
		return nil, err
	}
	if s.Buildq, err = s.newAccount(BuildqAccount, "", configureBuildq); err != nil {
		return nil, err
	}
	opPub, _ := op.PublicKey()
	oc := jwt.NewOperatorClaims(opPub)
	oc.Name = "buildq"
	oc.SystemAccount = s.System.PublicKey()
	if s.OperatorJWT, err = oc.Encode(op); err != nil {
		return nil, fmt.Errorf("sign the operator JWT: %w", err)
	}
	if _, err := s.AddTenants(tenants); err != nil {
		return nil, err
	}
	return s, nil
}

// Tenant returns tenant t's account.
func (s *JWTSetup) Tenant(t string) (Account, bool) {
	i := slices.IndexFunc(s.Tenants, func(a Account) bool { return a.Tenant == t })
	if i < 0 {
		return Account{}, false
	}
	return s.Tenants[i], true
}

// TenantNames are the setup's tenants in the order they were added.
func (s *JWTSetup) TenantNames() []string {
	out := make([]string, len(s.Tenants))
	for i, a := range s.Tenants {
		out[i] = a.Tenant
	}
	return out
}

// AddTenants signs an account for each tenant (with the operator's key, and
// its imports' activation tokens with BUILDQ's) and returns them. A tenant
// the setup already has is refused; nothing is added then.
func (s *JWTSetup) AddTenants(tenants []string) ([]Account, error) {
	if err := CheckTenants(tenants); err != nil {
		return nil, err
	}
	for _, t := range tenants {
		if _, ok := s.Tenant(t); ok {
			return nil, fmt.Errorf("tenant %q is already in the setup", t)
		}
	}
	var added []Account
	for _, t := range tenants {
		a, err := s.newAccount(TenantAccount(t), t, func(ac *jwt.AccountClaims) error {
			return s.configureTenant(ac, t)
		})
		if err != nil {
			return nil, err
		}
		added = append(added, a)
	}
	s.Tenants = append(s.Tenants, added...)
	return added, nil
}

func (s *JWTSetup) newAccount(name, tenant string, configure func(*jwt.AccountClaims) error) (Account, error) {
	kp, err := nkeys.CreateAccount()
	if err != nil {
		return Account{}, err
	}
	pub, _ := kp.PublicKey()
	ac := jwt.NewAccountClaims(pub)
	ac.Name = name
	if configure != nil {
		if err := configure(ac); err != nil {
			return Account{}, err
		}
	}
	token, err := ac.Encode(s.Operator)
	if err != nil {
		return Account{}, fmt.Errorf("sign account %s: %w", name, err)
	}
	return Account{Name: name, Tenant: tenant, Key: kp, JWT: token}, nil
}

// buildqExports are BUILDQ's exports: every tenant's subjects, each import
// authorized by an activation token.
func buildqExports() jwt.Exports {
	var ex jwt.Exports
	for _, s := range TenantServices("*") {
		ex.Add(&jwt.Export{Name: s, Subject: jwt.Subject(s), Type: jwt.Service, TokenReq: true})
	}
	for _, s := range TenantStreams("*") {
		ex.Add(&jwt.Export{Name: s, Subject: jwt.Subject(s), Type: jwt.Stream, TokenReq: true})
	}
	return ex
}

// MissingExports are the subjects BUILDQ exports now (buildqExports) that
// the setup's BUILDQ account JWT does not: a setup made by an earlier
// buildq lacks the services added since (buildq.api.logs.* for build
// logs, buildq.api.results.* for stored results). Its tenants' imports of those subjects authorize nothing (the
// server skips an import of a subject the exporter does not export), so
// those services are out of their reach until the setup is made anew.
func (s *JWTSetup) MissingExports() ([]string, error) {
	ac, err := jwt.DecodeAccountClaims(s.Buildq.JWT)
	if err != nil {
		return nil, fmt.Errorf("account %s: %w", BuildqAccount, err)
	}
	var missing []string
	for _, want := range buildqExports() {
		if !slices.ContainsFunc(ac.Exports, func(e *jwt.Export) bool {
			return e.Subject == want.Subject && e.Type == want.Type && e.TokenReq == want.TokenReq
		}) {
			missing = append(missing, string(want.Subject))
		}
	}
	return missing, nil
}

func configureBuildq(ac *jwt.AccountClaims) error {
	ac.Description = "buildq: the streams, the KV buckets, the workers and the operators"
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{
		MemoryStorage: jwt.NoLimit, DiskStorage: jwt.NoLimit,
		Streams: jwt.NoLimit, Consumer: jwt.NoLimit, MaxAckPending: jwt.NoLimit,
	}
	ac.Exports = buildqExports()
	return nil
}

func (s *JWTSetup) configureTenant(ac *jwt.AccountClaims, t string) error {
	ac.Description = "buildq tenant " + t
	imp := func(subject string, typ jwt.ExportType) error {
		act := jwt.NewActivationClaims(ac.Subject)
		act.Name = subject
		act.ImportSubject = jwt.Subject(subject)
		act.ImportType = typ
		token, err := act.Encode(s.Buildq.Key)
		if err != nil {
			return fmt.Errorf("sign the activation of %s for tenant %s: %w", subject, t, err)
		}
		ac.Imports.Add(&jwt.Import{
			Name: subject, Subject: jwt.Subject(subject), Account: s.Buildq.PublicKey(), Token: token, Type: typ,
		})
		return nil
	}
	for _, subj := range TenantServices(t) {
		if err := imp(subj, jwt.Service); err != nil {
			return err
		}
	}
	for _, subj := range TenantStreams(t) {
		if err := imp(subj, jwt.Stream); err != nil {
			return err
		}
	}
	return nil
}

// UserCreds makes a new user key pair for the user with the given key name
// (WorkerKey, AdminKey, SysKey or a tenant) and returns its credentials
// file (user JWT and seed, for nats --creds / buildq --nats-creds). The
// user's JWT is signed by its account's key and carries the same
// permissions as in config-file mode.
func (s *JWTSetup) UserCreds(user string) ([]byte, error) {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return nil, err
	}
	pub, _ := kp.PublicKey()
	uc := jwt.NewUserClaims(pub)
	var acc Account
	switch user {
	case WorkerKey:
		acc, uc.Name = s.Buildq, WorkerUser
		uc.Pub.Allow.Add(WorkerPublish()...)
		uc.Sub.Allow.Add(WorkerSubscribe()...)
		// allow_responses: true of config-file mode.
		uc.Resp = &jwt.ResponsePermission{MaxMsgs: 1, Expires: 2 * time.Minute}
	case AdminKey:
		acc, uc.Name = s.Buildq, AdminUser
	case SysKey:
		acc, uc.Name = s.System, SysUser
	default:
		a, ok := s.Tenant(user)
		if !ok {
			return nil, fmt.Errorf("no user %q: want %s, %s, %s or a tenant of the setup", user, WorkerKey, AdminKey, SysKey)
		}
		acc, uc.Name = a, user
		uc.Pub.Allow.Add(TenantServices(user)...)
		uc.Sub.Allow.Add(append(TenantStreams(user), TenantInboxes(user)...)...)
	}
	token, err := uc.Encode(acc.Key)
	if err != nil {
		return nil, fmt.Errorf("sign user %s: %w", uc.Name, err)
	}
	seed, err := kp.Seed()
	if err != nil {
		return nil, err
	}
	return jwt.FormatUserConfig(token, seed)
}

// The files of a setup, relative to its directory.
const (
	OperatorJWTFile = "operator.jwt"
	keysDir         = "keys"
	accountsDir     = "accounts"
	// ConfigFile is the server configuration, CredsDir the users'
	// credentials files (<key name>.creds) and ResolverDir the default
	// directory of the server's account resolver.
	ConfigFile  = "nats-server.conf"
	CredsDir    = "creds"
	ResolverDir = "jwt"
)

// File is one file of a setup.
type File struct {
	// Path is slash-separated and relative to the setup's directory.
	Path string
	Data []byte
	// Secret files (seeds) are for the owner's eyes only (mode 0600).
	Secret bool
}

// Files are the setup's keys and JWTs as files: operator.jwt,
// keys/<account>.nk (the operator's and each account's seed) and
// accounts/<account>.jwt. LoadJWTSetup reads them back. The users'
// credentials (UserCreds) and the server configuration (ServerConfig) are
// not among them.
func (s *JWTSetup) Files() ([]File, error) {
	opSeed, err := s.Operator.Seed()
	if err != nil {
		return nil, err
	}
	files := []File{
		{Path: OperatorJWTFile, Data: []byte(s.OperatorJWT + "\n")},
		{Path: path.Join(keysDir, "operator.nk"), Data: append(opSeed, '\n'), Secret: true},
	}
	for _, a := range append([]Account{s.System, s.Buildq}, s.Tenants...) {
		fs, err := AccountFiles(a)
		if err != nil {
			return nil, err
		}
		files = append(files, fs...)
	}
	return files, nil
}

// AccountFiles are one account's files: keys/<name>.nk and
// accounts/<name>.jwt.
func AccountFiles(a Account) ([]File, error) {
	seed, err := a.Key.Seed()
	if err != nil {
		return nil, err
	}
	return []File{
		{Path: path.Join(keysDir, a.Name+".nk"), Data: append(seed, '\n'), Secret: true},
		{Path: path.Join(accountsDir, a.Name+".jwt"), Data: []byte(a.JWT + "\n")},
	}, nil
}

// IsSetup says whether files (as Files names them) hold a setup: the
// operator's seed is there.
func IsSetup(files map[string][]byte) bool {
	_, ok := files[path.Join(keysDir, "operator.nk")]
	return ok
}

// LoadJWTSetup reads back a setup from its files (path as Files names
// them → content). It checks that every JWT is signed by the setup's keys
// and names the key it goes with. Tenants come in the order of their
// accounts' issue time.
func LoadJWTSetup(files map[string][]byte) (*JWTSetup, error) {
	get := func(p string) (string, error) {
		b, ok := files[p]
		if !ok {
			return "", fmt.Errorf("%s is missing", p)
		}
		return strings.TrimSpace(string(b)), nil
	}
	seed, err := get(path.Join(keysDir, "operator.nk"))
	if err != nil {
		return nil, err
	}
	op, err := nkeys.FromSeed([]byte(seed))
	if err != nil {
		return nil, fmt.Errorf("keys/operator.nk: %w", err)
	}
	opPub, _ := op.PublicKey()
	if !nkeys.IsValidPublicOperatorKey(opPub) {
		return nil, errors.New("keys/operator.nk: not an operator key")
	}
	s := &JWTSetup{Operator: op}
	if s.OperatorJWT, err = get(OperatorJWTFile); err != nil {
		return nil, err
	}
	oc, err := jwt.DecodeOperatorClaims(s.OperatorJWT)
	if err != nil {
		return nil, fmt.Errorf("%s: not an operator JWT: %w", OperatorJWTFile, err)
	}
	if oc.Subject != opPub {
		return nil, fmt.Errorf("%s: not the JWT of the operator of keys/operator.nk", OperatorJWTFile)
	}
	load := func(name string) (Account, *jwt.AccountClaims, error) {
		seed, err := get(path.Join(keysDir, name+".nk"))
		if err != nil {
			return Account{}, nil, err
		}
		kp, err := nkeys.FromSeed([]byte(seed))
		if err != nil {
			return Account{}, nil, fmt.Errorf("keys/%s.nk: %w", name, err)
		}
		a := Account{Name: name, Key: kp}
		if !nkeys.IsValidPublicAccountKey(a.PublicKey()) {
			return Account{}, nil, fmt.Errorf("keys/%s.nk: not an account key", name)
		}
		if a.JWT, err = get(path.Join(accountsDir, name+".jwt")); err != nil {
			return Account{}, nil, err
		}
		ac, err := jwt.DecodeAccountClaims(a.JWT)
		if err != nil {
			return Account{}, nil, fmt.Errorf("accounts/%s.jwt: %w", name, err)
		}
		if ac.Subject != a.PublicKey() || ac.Issuer != opPub || ac.Name != name {
			return Account{}, nil, fmt.Errorf("accounts/%s.jwt is not account %s of keys/%s.nk signed by the operator", name, name, name)
		}
		return a, ac, nil
	}
	if s.System, _, err = load(SystemAccount); err != nil {
		return nil, err
	}
	if oc.SystemAccount != s.System.PublicKey() {
		return nil, fmt.Errorf("%s names another system account than keys/%s.nk", OperatorJWTFile, SystemAccount)
	}
	if s.Buildq, _, err = load(BuildqAccount); err != nil {
		return nil, err
	}
	type issued struct {
		a  Account
		at int64
	}
	var tenants []issued
	for p := range files {
		dir, file := path.Split(p)
		name, ok := strings.CutSuffix(file, ".jwt")
		if dir != accountsDir+"/" || !ok || !strings.HasPrefix(name, "tenant-") {
			continue
		}
		a, ac, err := load(name)
		if err != nil {
			return nil, err
		}
		a.Tenant = strings.TrimPrefix(name, "tenant-")
		if err := CheckTenant(a.Tenant); err != nil {
			return nil, fmt.Errorf("accounts/%s.jwt: %w", name, err)
		}
		tenants = append(tenants, issued{a, ac.IssuedAt})
	}
	slices.SortStableFunc(tenants, func(x, y issued) int {
		return cmp.Or(cmp.Compare(x.at, y.at), strings.Compare(x.a.Tenant, y.a.Tenant))
	})
	for _, t := range tenants {
		s.Tenants = append(s.Tenants, t.a)
	}
	return s, nil
}

// ServerConfig is the nats-server configuration of the setup: the
// operator, the system account, a full account resolver in resolverDir
// (an absolute path is best: the server resolves a relative one against
// its working directory) and every account's JWT preloaded into it.
// JetStream is enabled; its store directory is left to the command line
// (nats-server -sd DIR).
func (s *JWTSetup) ServerConfig(resolverDir string) ([]byte, error) {
	if resolverDir == "" {
		return nil, errors.New("no resolver directory")
	}
	w := &confWriter{}
	w.comment(
		"nats-server configuration for buildq, decentralized (JWT) mode: the",
		"tenants are accounts of their own. Made by `buildq nats-config --mode jwt`;",
		"deploy/nats/README.md tells how to add a tenant.",
		"",
		"Why accounts: NATS checks the subject a user publishes to, never the reply",
		"subject. Were the tenants users of the account that holds the streams and",
		"buckets, a tenant could publish its request with the reply subject",
		"$KV.buildq-builds.<key>, and the server itself would write the PubAck into",
		"the bucket. Here a tenant imports its request subject and services as",
		"services: the server replaces the reply subject with an _R_... subject of",
		"its own and routes the answer or PubAck back into the tenant's account.",
		"",
		"Accounts (the server knows them by public key; their JWTs are below):",
	)
	w.comment(wrap(fmt.Sprintf("SYS %s: the system account. Its user (creds/sys.creds) pushes new accounts to the server (buildq nats-config --push).", s.System.PublicKey()), 76, "  ", "      ")...)
	w.comment(wrap(fmt.Sprintf("BUILDQ %s: the streams and buckets, with JetStream; users buildq-worker and buildq-admin (creds/worker.creds, creds/admin.creds). It exports every tenant's subjects as private wildcards (an import needs an activation token that BUILDQ signed for the importing account and the exact subject): services %s; streams %s.",
		s.Buildq.PublicKey(), strings.Join(TenantServices("*"), ", "), strings.Join(TenantStreams("*"), ", ")), 76, "  ", "      ")...)
	for _, a := range s.sortedTenants() {
		w.comment(wrap(fmt.Sprintf("%s %s: tenant %s, one user (creds/%s.creds). It imports the services %s and the streams %s, each with BUILDQ's activation. No JetStream.",
			a.Name, a.PublicKey(), a.Tenant, a.Tenant, strings.Join(TenantServices(a.Tenant), ", "), strings.Join(TenantStreams(a.Tenant), " and ")), 76, "  ", "      ")...)
	}
	w.comment(
		"",
		"Run (DIR is where buildq nats-config wrote this file):",
		"    nats-server -c DIR/nats-server.conf -sd /data/nats",
		"Adding a tenant T signs one new account; BUILDQ's JWT does not change and",
		"the server is not restarted:",
		"    buildq nats-config --mode jwt --dir DIR --tenant T --push nats://HOST:4222",
		"writes T's keys and creds/T.creds, pushes T's account JWT to the running",
		"server (as the system account's user) and rewrites this file with T's",
		"JWT preloaded.",
	)
	w.blank()
	w.line("port: 4222")
	w.comment(
		"JetStream on (only BUILDQ's account JWT enables it for an account). Its",
		"store directory is given on the command line (-sd /data/nats).",
	)
	w.line("jetstream: enabled")
	w.blank()
	w.comment("The operator, who signed every account JWT.")
	w.line("operator: %q", s.OperatorJWT)
	w.line("system_account: %q", s.System.PublicKey())
	w.blank()
	w.comment(
		"The full resolver keeps every account JWT in its directory and takes",
		"new and updated ones on $SYS.REQ.CLAIMS.UPDATE from the system",
		"account's user; accounts are never deleted through it.",
	)
	w.open("resolver: {")
	w.line("type: full")
	w.line("dir: %q", resolverDir)
	w.line("allow_delete: false")
	w.close("}")
	w.comment(
		"Stored into the resolver at start unless it holds a newer JWT of the",
		"same account.",
	)
	w.open("resolver_preload: {")
	for _, a := range append([]Account{s.System, s.Buildq}, s.sortedTenants()...) {
		w.comment(a.Name)
		w.line("%s: %q", a.PublicKey(), a.JWT)
	}
	w.close("}")
	return []byte(w.b.String()), nil
}

func (s *JWTSetup) sortedTenants() []Account {
	ts := slices.Clone(s.Tenants)
	slices.SortFunc(ts, func(a, b Account) int { return strings.Compare(a.Tenant, b.Tenant) })
	return ts
}

// wrap breaks text into lines of at most width characters (longer words
// stay whole), the first prefixed by first, the others by rest.
func wrap(text string, width int, first, rest string) []string {
	var lines []string
	line := first
	empty := true
	for _, word := range strings.Fields(text) {
		if !empty && len(line)+1+len(word) > width {
			lines = append(lines, line)
			line, empty = rest, true
		}
		if !empty {
			line += " "
		}
		line += word
		empty = false
	}
	return append(lines, line)
}
