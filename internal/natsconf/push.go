package natsconf

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
)

// ClaimsUpdateSubject is where a server with a full account resolver takes
// new and updated account JWTs from users of the system account.
const ClaimsUpdateSubject = "$SYS.REQ.CLAIMS.UPDATE"

// claimsUpdateReply is nats-server's answer on ClaimsUpdateSubject
// (server.ServerAPIClaimUpdateResponse): data on success, error otherwise.
type claimsUpdateReply struct {
	Server *struct {
		Name string `json:"name"`
		ID   string `json:"id"`
	} `json:"server"`
	Data *struct {
		Account string `json:"account"`
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"data"`
	Error *struct {
		Account     string `json:"account"`
		Code        int    `json:"code"`
		Description string `json:"description"`
	} `json:"error"`
}

// PushAccount hands an account JWT to a running server on
// ClaimsUpdateSubject; nc must be connected as a user of the system account.
// It returns the server's message ("jwt updated"), or an error that carries
// the server's description of why it refused the JWT. In a cluster every
// server answers; this reads the first answer (the servers share the JWT
// among themselves).
//
// This is the one function of the package that does I/O.
func PushAccount(ctx context.Context, nc *nats.Conn, accountJWT string) (string, error) {
	ac, err := jwt.DecodeAccountClaims(accountJWT)
	if err != nil {
		return "", fmt.Errorf("not an account JWT: %w", err)
	}
	msg, err := nc.RequestWithContext(ctx, ClaimsUpdateSubject, []byte(accountJWT))
	if errors.Is(err, nats.ErrNoResponders) {
		return "", fmt.Errorf("push account %s (%s): nobody answers on %s: connect as the system account's user (creds/sys.creds), to a server with a full account resolver", ac.Name, ac.Subject, ClaimsUpdateSubject)
	}
	if err != nil {
		return "", fmt.Errorf("push account %s (%s): %w", ac.Name, ac.Subject, err)
	}
	var r claimsUpdateReply
	if err := json.Unmarshal(msg.Data, &r); err != nil {
		return "", fmt.Errorf("push account %s (%s): the server's answer is not JSON: %q", ac.Name, ac.Subject, msg.Data)
	}
	switch {
	case r.Error != nil:
		return "", fmt.Errorf("push account %s (%s): refused by the server: %s", ac.Name, ac.Subject, r.Error.Description)
	case r.Data == nil:
		return "", fmt.Errorf("push account %s (%s): unexpected answer %s", ac.Name, ac.Subject, msg.Data)
	}
	return r.Data.Message, nil
}
