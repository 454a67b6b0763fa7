package natsconf

import (
	"fmt"

	"github.com/nats-io/nkeys"
)

// UserKey is a user's nkey pair.
type UserKey struct {
	// User is the key name: WorkerKey, AdminKey or a tenant.
	User string
	// Seed is the secret (SU…), for the user's seed file (--nats-nkey).
	Seed []byte
	// Public is the public key (U…), for the server's configuration.
	Public string
}

// NewUserKeys makes a new user key pair for each key name.
func NewUserKeys(users []string) ([]UserKey, error) {
	out := make([]UserKey, 0, len(users))
	for _, u := range users {
		kp, err := nkeys.CreateUser()
		if err != nil {
			return nil, fmt.Errorf("nkey for %s: %w", u, err)
		}
		seed, err := kp.Seed()
		if err != nil {
			return nil, err
		}
		pub, err := kp.PublicKey()
		if err != nil {
			return nil, err
		}
		out = append(out, UserKey{User: u, Seed: seed, Public: pub})
	}
	return out, nil
}

// PublicKeys maps each key's user to its public key, as ConfigOptions.NKeys
// wants them.
func PublicKeys(keys []UserKey) map[string]string {
	m := make(map[string]string, len(keys))
	for _, k := range keys {
		m[k.User] = k.Public
	}
	return m
}
